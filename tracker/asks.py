"""Route asks claimed once across the tracker group (the `MESH_ROUTE_ASKS` key-value bucket).

The gateway asks again when a tracker does not answer in time: on the retry subject, which
every tracker reads. A tracker that was frozen meanwhile still reads the first ask when it
wakes. Whoever opens a route for an ask first claims the ask's `request_id` with a
compare-and-set create; every other copy of the ask, read by another tracker or by the same
one later, loses the claim and is given that route again instead of opening a second one.
"""

from __future__ import annotations

import asyncio
import logging

from bus.client import Bus
from bus.jetstream import KeyValueStore
from schemas.route import CLAIM_ROUND_TRIPS, RouteRequest, RouteSession

log = logging.getLogger("meshnet.tracker")

ASK_BUCKET = "MESH_ROUTE_ASKS"
ASK_TTL_S = 600.0  # a claim is kept this long; an ask older than this is never answered
CLAIM_TIMEOUT_S = 0.1  # a claim waits at most this for JetStream (it answers in about 1 ms), plus its round trips


def claim_wait_s(bus_rtt_s: float) -> float:
    """How long a claim waits for JetStream on a bus whose round trip is `bus_rtt_s` (pure): a
    tracker far from its server needs its round trips, or every claim times out and opens its
    route unclaimed (a second route for an ask another tracker holds)."""
    return CLAIM_TIMEOUT_S + CLAIM_ROUND_TRIPS * bus_rtt_s


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

    def __init__(self, kv: KeyValueStore | None) -> None:
        self._kv = kv

    @classmethod
    async def open(cls, bus: Bus) -> AskClaims:
        """The claims bucket (made when missing); a bucket-less AskClaims when JetStream is not there."""
        try:
            return cls(await KeyValueStore.open(bus, ASK_BUCKET, create=True, ttl_s=ASK_TTL_S))
        except Exception as exc:
            log.warning("route ask bucket unavailable, asks are not claimed: %s", exc)
            return cls(None)

    async def claim(self, session: RouteSession, bus_rtt_s: float = 0.0) -> RouteSession:
        """The route that holds `session`'s ask: `session` itself when this claim is first (or
        the ask has no request id, or JetStream does not answer within `claim_wait_s`), else
        the route another claim opened for it."""
        if self._kv is None or not session.request_id:
            return session
        key = f"ask.{session.request_id}"
        value = session.model_dump(mode="json")
        try:
            async with asyncio.timeout(claim_wait_s(bus_rtt_s)):
                if await self._kv.replace_json(key, value, 0):
                    return session
                held = await self._kv.get_json(key)
        except Exception as exc:  # any failure: the route opens, as it would with no bucket
            log.warning("claim of route ask %s failed (%s): opening its route unclaimed", session.request_id,
                        exc or type(exc).__name__)
            return session
        return RouteSession.model_validate(held) if held else session
