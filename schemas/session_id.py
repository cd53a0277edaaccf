"""Route Session ids derived from a client's (pure): a restart's route is `<id>-e<epoch>`, choice
i of a request with `n` > 1 is `<id>-n<i>`. Ids are at most MAX_SESSION_ID characters, so an id
too long to take a suffix keeps its start and a digest of the whole id in place of its end: two
long ids alike in their start stay apart, and the tracker still knows the routes of one client
session for what they are (tracker/routing.same_session)."""

from __future__ import annotations

import hashlib
import re

MAX_SESSION_ID = 64
SUFFIX_ROOM = 8  # the longest suffix: "-e999999"
DIGEST_CHARS = 12
_EPOCH_SUFFIX = re.compile(r"-e\d+$")


def id_base(session_id: str) -> str:
    """The part of a derived id before its suffix: the id itself when short enough."""
    if len(session_id) <= MAX_SESSION_ID - SUFFIX_ROOM:
        return session_id
    digest = hashlib.sha256(session_id.encode()).hexdigest()[:DIGEST_CHARS]
    return f"{session_id[: MAX_SESSION_ID - SUFFIX_ROOM - DIGEST_CHARS - 1]}-{digest}"


def derived_session_id(session_id: str, suffix: str) -> str:
    """`session_id` with `suffix` (at most SUFFIX_ROOM characters), within MAX_SESSION_ID."""
    if len(suffix) > SUFFIX_ROOM:
        raise ValueError(f"session id suffix {suffix!r} is longer than {SUFFIX_ROOM}")
    return id_base(session_id) + suffix


def without_epoch(session_id: str) -> str:
    """The id without its restart suffix ("-e<epoch>"), if it has one."""
    m = _EPOCH_SUFFIX.search(session_id)
    return session_id[:m.start()] if m else session_id
