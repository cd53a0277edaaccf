"""Route asks claimed once across the tracker group (the `MESH_ROUTE_ASKS` key-value bucket).

The gateway asks again when a tracker does not answer in time: on the retry subject, which
every tracker reads. A tracker that was frozen meanwhile still reads the first ask when it
wakes. Whoever opens a route for an ask first claims the ask's `request_id` with a
compare-and-set create; every other copy of the ask, read by another tracker or by the same
one later, loses the claim and is given that route again instead of opening a second one.

A route opens only on the server's answer. A claim left without one (a tracker cut off from
its server mid-claim, whose create may or may not have landed) is made again until answered (a
create that landed reads back as this tracker's own); one unanswered for CLAIM_SETTLE_S opens
nothing and is not answered: the asker asks every tracker again, as of a tracker that froze.
"""

from __future__ import annotations

import asyncio
import logging

from bus.client import Bus
from bus.jetstream import KeyValueStore, refused_by_server
from schemas.route import RouteRequest, RouteSession

log = logging.getLogger("meshnet.tracker")

ASK_BUCKET = "MESH_ROUTE_ASKS"
ASK_TTL_S = 600.0  # a claim is kept this long; an ask older than this is never answered
CLAIM_ATTEMPT_S = 5.0  # one attempt waits this for JetStream's answer (it answers in about 1 ms)
CLAIM_SETTLE_S = 30.0  # a claim without an answer is tried again for this long (past the asker's wait)
CLAIM_PAUSE_S = 0.25  # between attempts


class ClaimUnsettled(Exception):
    """No answer to a claim: it may hold the ask or not, so no route may open for the ask here."""


def ask_expired(req: RouteRequest, now_wall: float, unread_max_s: float, ttl_s: float = ASK_TTL_S) -> bool:
    """Whether an ask was sent so long ago that its claim may be gone (pure). `req.ts` is the
    asker's wall clock and `now_wall` this tracker's, so their difference is the ask's age plus
    the skew between the two machines. Only a tracker that could have left the ask unread for
    longer than a claim lasts (`unread_max_s`: it was just paused that long) judges it by that
    difference; any other tracker read it within seconds, whatever the clocks say."""
    return unread_max_s > ttl_s and now_wall - req.ts > ttl_s


def skew_note(req: RouteRequest, now_wall: float, ttl_s: float = ASK_TTL_S) -> str | None:
    """What to log when an ask's stamp is more than `ttl_s` off this tracker's clock (pure):
    the two machines' wall clocks disagree by about that much. None when they roughly agree."""
    skew = now_wall - req.ts
    if abs(skew) <= ttl_s:
        return None
    side = "behind" if skew > 0 else "ahead of"
    return (f"clock skew: route ask {req.request_id or '?'} from driver {req.driver_id or '?'} is stamped "
            f"{abs(skew):.0f}s {side} this tracker's wall clock (over {ttl_s:.0f}s): the asker's and this "
            "tracker's clocks disagree; the ask is served, but fix the clocks (NTP)")


class AskClaims:
    """Claims of route asks by request id. Without JetStream, every claim is granted."""

    def __init__(self, kv: KeyValueStore | None, settle_s: float = CLAIM_SETTLE_S,
                 attempt_s: float = CLAIM_ATTEMPT_S) -> None:
        self._kv = kv
        self.settle_s = settle_s
        self.attempt_s = attempt_s

    @classmethod
    async def open(cls, bus: Bus) -> AskClaims:
        """The claims bucket (made when missing); a bucket-less AskClaims when JetStream is not there."""
        try:
            return cls(await KeyValueStore.open(bus, ASK_BUCKET, create=True, ttl_s=ASK_TTL_S))
        except Exception as exc:
            log.warning("route ask bucket unavailable, asks are not claimed: %s", exc)
            return cls(None)

    async def claim(self, session: RouteSession) -> RouteSession:
        """The route that holds `session`'s ask: `session` itself when this claim is first (or
        the ask has no request id, or the server refused the claim outright: the route opens
        unclaimed, as with no bucket), else the route another claim opened for it.

        An attempt left without an answer (no answer within `attempt_s`, a connection lost
        mid-call) may have landed: it is made again, so a create that landed is read back as
        this claim's own, until `settle_s` has passed; then ClaimUnsettled."""
        if self._kv is None or not session.request_id:
            return session
        key = f"ask.{session.request_id}"
        value = session.model_dump(mode="json")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_s
        while True:
            try:
                async with asyncio.timeout(min(self.attempt_s, max(0.0, deadline - loop.time()))):
                    if await self._kv.replace_json(key, value, 0):
                        return session
                    held = await self._kv.get_json(key)
                return RouteSession.model_validate(held) if held else session
            except Exception as exc:
                reason = str(exc) or type(exc).__name__
                if refused_by_server(exc):
                    log.warning("claim of route ask %s refused (%s): opening its route unclaimed",
                                session.request_id, reason)
                    return session
                if loop.time() + CLAIM_PAUSE_S >= deadline:
                    raise ClaimUnsettled(f"claim of route ask {session.request_id} unanswered for "
                                         f"{self.settle_s:.0f}s ({reason})") from exc
                log.warning("claim of route ask %s unanswered (%s): trying again", session.request_id, reason)
            await asyncio.sleep(CLAIM_PAUSE_S)
