"""SessionTable: every Route Session on this node; opens, ends, expires and frees them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from nodes.server.hop_machine import Adopted, Freed, HopPhase
from nodes.server.seam_log import SeamLog
from nodes.server.session import FrameHook, HopConfig, HopSession
from schemas.capability import CapabilityReport
from schemas.frames import FrameError, FrameHeader
from schemas.route import RouteFailure, RouteSession
from schemas.sampling import SamplingParams

log = logging.getLogger("meshnet.node.sessions")

MAX_ENDED = 1024  # ended sessions remembered so late frames get "closed", not "unknown"
MAX_REFUSED = 256
OPEN_WAIT_S = 30.0  # past the grace period, a frame waits this long for an open its directive began
# how long a session that lost another hop keeps its Hot KV State for a restart: longer than a
# restart may wait for a lost node the tracker holds out (10 s hold and 5 s to be heard from
# again, gateway/held_wait.py), or such a restart finds its kept hops freed and spends another
# restart rebuilding every hop
KEEP_S = 20.0


def lost_from(old: RouteSession, new: RouteSession) -> bool:
    """Whether `old` has a hop whose node `new` left out: a restart's route, which may
    continue `old`'s sessions (pure)."""
    kept = {h.node_id for h in new.hops}
    return any(h.node_id not in kept for h in old.hops)


EndHook = Callable[[HopSession], Awaitable[None]]


def refusal_reason(route: RouteSession, hop_index: int, cap: CapabilityReport) -> str | None:
    """Why this node cannot serve hop `hop_index` of `route`, or None if it can."""
    hop = route.hops[hop_index]
    if (hop.layer_start, hop.layer_end) != (cap.layers.start, cap.layers.end):
        return f"hop wants layers [{hop.layer_start},{hop.layer_end}), node serves {cap.layers}"
    if route.n_layer != cap.layers.n_layer:
        return f"route has {route.n_layer} layers, model has {cap.layers.n_layer}"
    if route.model_revision != cap.model_revision:
        return f"route wants revision {route.model_revision}, node has {cap.model_revision}"
    if route.cache_abi != cap.cache_abi:
        return f"route wants cache ABI {route.cache_abi}, node has {cap.cache_abi}"
    if route.hidden_size != cap.hidden_size:
        return f"route hidden size {route.hidden_size} != shard hidden size {cap.hidden_size}"
    if hop.kv_profile != cap.kv_profile:  # the gateway chose how to replay a restart by it
        return f"hop says KV profile {hop.kv_profile}, node runs {cap.kv_profile}"
    return None


class SessionTable:
    """Owns every HopSession on this node and the Hot KV State each one holds."""

    def __init__(self, cfg: HopConfig, capability: CapabilityReport, *, max_sessions: int,
                 lease_s: float, grace_s: float = 1.0, keep_s: float = KEEP_S) -> None:
        self.cfg = cfg
        self.capability = capability
        self.max_sessions = max_sessions
        self.lease_s = lease_s
        self.grace_s = grace_s
        self.live: dict[str, HopSession] = {}
        self.ended: OrderedDict[str, HopSession] = OrderedDict()
        self.refused: OrderedDict[str, str] = OrderedDict()
        self.keep_s = keep_s
        self.parked: OrderedDict[str, HopSession] = OrderedDict()  # the ended ones in the PARKED phase, oldest first
        self.kept_total = 0  # sessions a restart continued here
        self._opened: dict[str, asyncio.Event] = {}
        self._opening: set[str] = set()
        self._adopting: set[str] = set()  # parked sessions a restart's open is continuing (its slot)
        self.on_ended: list[EndHook] = []  # audit, abort directives: called once per session
        self.on_frame: list[FrameHook] = []  # hop telemetry: called after every finished frame
        self.ended_total = 0

    @property
    def free_slots(self) -> int:
        return max(0, self.max_sessions - len(self.live) - len(self._opening))

    async def open(self, route: RouteSession, hop_index: int) -> str | None:
        """Open hop `hop_index` of `route` on this node; return a refusal reason or None.

        A Kept Hop (the hop names `keep_session`) continues that session's Hot KV State instead
        of taking a new slot; it is refused if this node no longer holds enough of it."""
        sid = route.session_id
        if sid in self.live or sid in self._opening or sid in self.ended:
            return None  # directives are idempotent
        hop = route.hops[hop_index]
        reason = refusal_reason(route, hop_index, self.capability)
        if reason is None and not hop.keep_session and self.free_slots <= 0:
            reason = f"no free session slot (max {self.max_sessions})"
        if reason is not None:
            self._remember_refusal(sid, reason)
            log.warning("refused session %s hop %d: %s", sid, hop_index, reason)
            self._wake(sid)
            return reason
        self._opening.add(sid)
        try:
            sampling = route.sampling if hop_index == len(route.hops) - 1 else None
            if hop.keep_session:
                self._adopting.add(hop.keep_session)
                log_rows = await self._adopt(route, hop.keep_session, sid, hop.keep_position, sampling)
            else:
                await self._evict_parked()
                await self.cfg.runner.open_session(sid, sampling)
                log_rows = None
        except Exception as exc:
            self._remember_refusal(sid, f"engine refused: {exc}")
            log.warning("engine could not open session %s: %s", sid, exc)
            return str(exc)
        finally:
            self._opening.discard(sid)
            self._adopting.discard(hop.keep_session or "")
            self._wake(sid)
        hs = HopSession(route=route, hop_index=hop_index, cfg=self.cfg, on_failed=self._failed,
                        on_frame=self._frame_done, kept=hop.kept, seam_log=log_rows)
        self.live[sid] = hs
        hs.start()
        log.info("opened session %s route %s hop %d/%d%s", sid, route.route_id, hop_index, len(route.hops),
                 f" (continues {hop.keep_session} at {hop.keep_position})" if hop.keep_session else "")
        return None

    async def _adopt(self, route: RouteSession, old_sid: str, sid: str, keep: int,
                     sampling: SamplingParams | None) -> SeamLog | None:
        """Hand `old_sid`'s Hot KV State (cut to `keep` positions) to `sid`; its Seam Log too."""
        live = self.live.get(old_sid)
        if live is not None:  # the restart came before this hop heard of the loss
            if not lost_from(live.route, route):
                raise LookupError(f"session {old_sid} lost no hop: a restart cannot continue it")
            await self.end(old_sid, HopPhase.ABORTED, f"continued by session {sid}", park=True)
        old = self.parked.get(old_sid)
        if old is not None:
            await old.stopped.wait()  # ending right now: continued once its worker stopped
        if old is None or self.parked.get(old_sid) is not old:
            raise LookupError(f"this node holds no Hot KV State of session {old_sid} to continue")
        del self.parked[old_sid]
        old.apply(Adopted())
        seam_log = old.drop_logs()
        try:
            await self.cfg.runner.adopt_session(old_sid, sid, keep, sampling)
        except Exception:
            await self.cfg.runner.close_session(old_sid)
            raise
        if seam_log is not None:
            if seam_log.length < keep:
                await self.cfg.runner.close_session(sid)
                raise LookupError(f"the Seam Log of {old_sid} holds {seam_log.length} rows, not {keep}")
            seam_log.truncate(keep)
        self.kept_total += 1
        return seam_log

    async def _evict_parked(self) -> None:
        """Free the oldest parked sessions until the sessions opening have engine slots (a
        parked session counts as free in `free_slots`: it is only kept in case it helps). One a
        restart's open is continuing is not freed: its slot is that open's."""
        while True:
            spare = [old for old in self.parked if old not in self._adopting]
            if not spare or len(self.live) + len(self._opening) + len(spare) <= self.max_sessions:
                return
            await self._free_parked(spare[0], "its slot was needed")

    async def _free_parked(self, old_sid: str, why: str) -> None:
        """Free a parked session's Hot KV State (once its worker has stopped), unless a restart
        took it meanwhile."""
        hs = self.parked.pop(old_sid, None)
        if hs is None:
            return
        hs.apply(Freed())
        await hs.stopped.wait()
        hs.drop_logs()
        try:
            await self.cfg.runner.close_session(old_sid)
        except Exception:
            log.exception("engine failed to free parked session %s", old_sid)
        log.info("freed the kept state of session %s: %s", old_sid, why)

    def _remember_refusal(self, sid: str, reason: str) -> None:
        self.refused[sid] = reason
        while len(self.refused) > MAX_REFUSED:
            self.refused.popitem(last=False)

    def _wake(self, sid: str) -> None:
        ev = self._opened.pop(sid, None)
        if ev is not None:
            ev.set()

    async def lookup(self, sid: str, *, wait: bool = True) -> HopSession | FrameError:
        """The live session, waiting up to the grace period for its open directive, and once
        the directive came, for its open to finish (the engine allocates on its own thread,
        behind the model call in progress, which can outlast the grace period under load), up
        to OPEN_WAIT_S more."""
        if wait and sid not in self.live:
            loop = asyncio.get_running_loop()
            grace_until = loop.time() + self.grace_s
            while sid not in self.live and sid not in self.ended and sid not in self.refused:
                left = grace_until + (OPEN_WAIT_S if sid in self._opening else 0.0) - loop.time()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):  # then look again: the open may have begun
                    await asyncio.wait_for(self._opened.setdefault(sid, asyncio.Event()).wait(), left)
            if sid not in self._opening:
                self._opened.pop(sid, None)  # nothing to wake for (each waiter above looks again)
        return self.find(sid)

    def find(self, sid: str) -> HopSession | FrameError:
        """The live session, or the typed error a frame for `sid` gets now (no waiting)."""
        hs = self.live.get(sid)
        if hs is not None:
            return hs
        if sid in self.ended:
            r = self.ended[sid].life
            if r.ended is HopPhase.FAILED and r.failure is not None:
                return FrameError(code="session_failed", message=r.failure.reason, failure=r.failure)
            return FrameError(code="session_closed", message=f"session {r.status}: {r.reason}",
                              failure=r.failure if r.ended is HopPhase.ABORTED else None)
        if sid in self.refused:
            return FrameError(code="session_refused", message=self.refused[sid])
        return FrameError(code="unknown_session", message=f"no open directive for session {sid}")

    async def end(self, sid: str, how: HopPhase, reason: str,
                  failure: RouteFailure | None = None, *, park: bool | None = None) -> bool:
        """End a session `how`: stop its worker, free its cache, or park it (hop_machine.End:
        `parks`, unless `park` says), report it. False if it was not live."""
        hs = self.live.pop(sid, None)
        keep_until = time.monotonic() + self.keep_s if self.keep_s > 0 else None
        if hs is None or not hs.end(how, reason, failure, keep_until=keep_until, park=park):
            return False
        self.ended[sid] = hs
        while len(self.ended) > MAX_ENDED:
            self.ended.popitem(last=False)
        parked = hs.life.phase is HopPhase.PARKED
        if parked:  # at once: a restart may come while the worker stops (_adopt waits for it)
            self.parked[sid] = hs
        await hs.stop()
        if not parked:
            hs.drop_logs()
            try:
                await self.cfg.runner.close_session(sid)
                hs.cache_bytes_estimate = 0
            except Exception:
                log.exception("engine failed to free session %s", sid)
        self.cfg.drafter.forget(sid)
        self.ended_total += 1
        log.info("session %s %s: %s", sid, how, reason)
        for hook in self.on_ended:
            try:
                await hook(hs)
            except Exception:
                log.exception("session-end hook failed for %s", sid)
        return True

    def _frame_done(self, hs: HopSession, header: FrameHeader) -> None:
        for hook in self.on_frame:
            hook(hs, header)

    async def _failed(self, hs: HopSession, failure: RouteFailure) -> None:
        await self.end(hs.session_id, HopPhase.FAILED, failure.reason, failure)

    async def expire_idle(self, now: float | None = None) -> list[str]:
        """End every session idle (no frame in flight) for longer than the lease; return their ids."""
        now = time.monotonic() if now is None else now
        stale = [sid for sid, hs in self.live.items()
                 if hs.counters.buffered == 0 and now - hs.last_active > self.lease_s]
        for sid in stale:
            await self.end(sid, HopPhase.EXPIRED, f"idle for more than {self.lease_s:.0f}s")
        for sid in [sid for sid, hs in self.parked.items() if (hs.life.kept_until or 0.0) <= now]:
            await self._free_parked(sid, f"no restart continued it within {self.keep_s:g}s")
        return stale

    async def close_all(self, reason: str) -> None:
        """End every live session (node shutdown). Each ends as a loss of this hop
        (`hop_lost` naming this node): the gateway's restart then leaves this node, and the
        node's process, out of its new route, and the tracker keeps it out of new routes at
        once (a `session_closed` named no node: the restart was given this same, closing node
        again and used up a restart on it)."""
        for sid in list(self.live):
            hs = self.live.get(sid)
            if hs is None:
                continue
            lost = hs.make_failure(hs.phase, f"{reason}: node {hs.cfg.node_id} is leaving the mesh",
                                   hs.hop_index, code="hop_lost")
            await self.end(sid, HopPhase.CLOSED, reason, lost, park=False)
        while self.parked:
            await self._free_parked(next(iter(self.parked)), reason)
