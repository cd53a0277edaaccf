"""Issuing a Route Session's frame credentials (the scheme: schemas/credentials.py)."""

from __future__ import annotations

from collections.abc import Mapping

from schemas.credentials import hop_credential, seal
from schemas.route import DIRECT_RETURN_HOPS, RouteSession


def grant_credentials(session: RouteSession, keys: Mapping[str, bytes],
                      expires_at: int) -> tuple[RouteSession, list[str]]:
    """The session with its expiry, each hop's sealed next credential and the head's sealed
    return credential (what the open directive may carry), and C_0..C_n-1 (what only the gateway gets). Pure; every hop's node
    must have a key in `keys` (the tracker routes only through nodes whose key it holds)."""
    sid, rid, epoch = session.session_id, session.route_id, session.epoch
    creds = [hop_credential(keys[h.node_id], sid, rid, epoch, i, expires_at) for i, h in enumerate(session.hops)]
    hops = [
        h.model_copy(update={"sealed_next": seal(keys[h.node_id], creds[i + 1], sid, rid, epoch, i, expires_at)
                             if i + 1 < len(creds) else ""})
        for i, h in enumerate(session.hops)
    ]
    if len(hops) >= DIRECT_RETURN_HOPS:  # the head opens the tail's Return Stream with the tail's credential
        head = hops[0]
        hops[0] = head.model_copy(update={"sealed_return": seal(
            keys[head.node_id], creds[-1], sid, rid, epoch, 0, expires_at, purpose="seal-return")})
    return session.model_copy(update={"hops": hops, "expires_at": expires_at}), creds
