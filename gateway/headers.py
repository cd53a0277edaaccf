"""Meshnet's own request headers, sent more than once.

aiohttp keeps every copy of a repeated header, and `request.headers.get` reads the first: a
request with `x-meshnet-route-policy: private` and then `x-meshnet-route-policy: public` ran
on whichever came first, and two `Authorization` headers were checked by the first alone.
Where the copies disagree the gateway cannot know which one the client meant, so it answers
400 `duplicate_header` naming the header, before the API key check and before any handler;
copies with the same value (a proxy that repeats one) are one value. A header whose value
is a comma-separated list (`x-meshnet-allow-nodes`) is the list of all its copies, as HTTP
defines a repeated list header (RFC 9110, 5.3): `list_header`.
"""

from __future__ import annotations

from multidict import CIMultiDictProxy

from gateway.chat_request import ALLOW_HEADER
from gateway.errors import InvalidRequestError
from gateway.session_ids import SESSION_HEADER

OWN_PREFIX = "x-meshnet-"  # every x-meshnet-* header, today's and any later one
SINGLE_HEADERS = ("Authorization", SESSION_HEADER)  # case-sensitive values: compared as sent
LIST_HEADERS = frozenset({ALLOW_HEADER})  # comma-separated lists: their copies add up


def _values(headers: CIMultiDictProxy[str], name: str) -> set[str]:
    """The distinct values of a header (pure); an x-meshnet-* word's case does not count."""
    values = {v.strip() for v in headers.getall(name, [])}
    return {v.lower() for v in values} if name.lower().startswith(OWN_PREFIX) else values


def conflicting_header(headers: CIMultiDictProxy[str]) -> InvalidRequestError | None:
    """The 400 for the first of Meshnet's own headers sent with different values (pure); its
    values are not repeated (an Authorization header carries a key)."""
    own = {k.lower() for k in headers if k.lower().startswith(OWN_PREFIX) and k.lower() not in LIST_HEADERS}
    for name in (*SINGLE_HEADERS, *sorted(own)):
        if len(_values(headers, name)) > 1:
            count = len(headers.getall(name))
            return InvalidRequestError(f"the {name} header was sent {count} times with different values; send it "
                                       "once", param=name, code="duplicate_header")
    return None


def list_header(headers: CIMultiDictProxy[str], name: str) -> str | None:
    """A comma-separated list header's value: all its copies joined (None when absent)."""
    values = headers.getall(name, [])
    return ",".join(values) if values else None
