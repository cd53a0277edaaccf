"""Writing chunked HTTP bodies (reading them is llhttp's job, in wire.client and wire.server)."""

from __future__ import annotations

from collections.abc import Sequence

LAST_CHUNK = b"0\r\n\r\n"


def encode_chunks(payloads: Sequence[bytes]) -> bytes:
    """Each payload as one chunk of a chunked HTTP body (an empty payload would end the body,
    so callers never pass one)."""
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in payloads)


def chunk_wire_bytes(payload: bytes) -> int:
    """Bytes one chunk of `payload` takes on the wire: size line, payload, CRLF."""
    return len(payload) + len(b"%x" % len(payload)) + 4
