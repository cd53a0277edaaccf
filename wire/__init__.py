"""The activation transport: HTTP/1.1 between a caller and the hops of a route.

A plane of its own, like bus/: it imports only schemas/, and nodes and the gateway import it.
HTTP is parsed by llhttp (httptools), the parser aiohttp and uvloop build on, on both sides:
wire.client (one keep-alive connection to a hop), wire.link (one session's frames to one hop,
with credit), wire.server (a node's listening socket). The frame contracts themselves (header,
results, errors, the row codec) are schemas/frames.py. See docs/activation-protocol.md.
"""
