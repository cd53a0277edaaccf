"""Quarantine on the bus: verdicts in, notices out, the operator's lift, and the bucket.

Every tracker reads every verdict (mesh.audit.validation_verdict.validator: only the
validator's user may publish there) and decides the same way (tracker/quarantine.py). The
one that decides first publishes a QuarantineNotice on mesh.tracker.quarantine and stores it
in the MESH_QUARANTINE bucket; the others apply the notice as it comes, and a tracker that
starts later reads the bucket. `meshnet tracker unquarantine NODE` asks every tracker to lift
one (tracker credentials): the quarantine ends and the evidence against the node is dropped.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from bus import subjects
from bus.client import Bus, Responder, Subscription
from bus.jetstream import KeyValueStore
from schemas.audit import ValidationVerdict
from schemas.validation import QUARANTINE_BUCKET, QuarantineNotice, UnquarantineRequest
from tracker.quarantine import DEFAULT_MIN_FAILS, VerdictBook, VerdictFacts, decide

log = logging.getLogger("meshnet.tracker.quarantine")

VERDICT_SUBJECT = subjects.audit(subjects.VERDICT_KIND, "validator")


class QuarantineKeeper:
    """The set of quarantined nodes of one tracker; `on_change(node_id)` after each change."""

    def __init__(self, bus: Bus, tracker_id: str, on_change: Callable[[str], None], *,
                 min_fails: int = DEFAULT_MIN_FAILS) -> None:
        self.bus = bus
        self.tracker_id = tracker_id
        self.on_change = on_change
        self.min_fails = min_fails
        self.book = VerdictBook()
        self.notices: dict[str, QuarantineNotice] = {}  # quarantined node -> why
        self._kv: KeyValueStore | None = None
        self._lift: Responder | None = None

    def holds(self, node_id: str) -> bool:
        return node_id in self.notices

    async def start(self, stack: contextlib.AsyncExitStack) -> list[tuple[Subscription, Callable]]:
        """Subscribe, read the bucket, answer lifts; returns each subscription with its
        handler, for the owner to consume (Tracker._consume)."""
        verdicts = await stack.enter_async_context(self.bus.subscribe(VERDICT_SUBJECT, ValidationVerdict))
        notices = await stack.enter_async_context(self.bus.subscribe(subjects.QUARANTINE, QuarantineNotice))
        try:
            self._kv = await KeyValueStore.open(self.bus, QUARANTINE_BUCKET, create=True)
            for node_id, value in (await self._kv.items()).items():
                notice = QuarantineNotice.model_validate(value)
                if notice.action == "quarantine":
                    self.notices[node_id] = notice
        except Exception as exc:  # no JetStream yet: notices still arrive on the bus
            log.warning("quarantine bucket unavailable: %s", exc)
        if self.notices:
            log.warning("nodes in quarantine: %s", ", ".join(sorted(self.notices)))
        self._lift = await self.bus.serve(subjects.UNQUARANTINE, UnquarantineRequest, self.lift)
        return [(verdicts, self.on_verdict), (notices, self.on_notice)]

    async def stop(self) -> None:
        if self._lift is not None:
            await self._lift.stop()
            self._lift = None

    async def on_verdict(self, v: ValidationVerdict) -> None:
        if not self.book.add(VerdictFacts(v.event_id, tuple(v.implicated), tuple(v.cleared))):
            return
        for d in decide(self.book.verdicts, min_fails=self.min_fails, already=self.notices):
            notice = QuarantineNotice(node_id=d.node_id, action="quarantine", reason=d.reason,
                                      verdict_ids=list(d.verdict_ids), issued_by=self.tracker_id)
            self._apply(notice)
            await self.bus.publish(subjects.QUARANTINE, notice)
            await self._store(notice)

    async def on_notice(self, notice: QuarantineNotice) -> None:
        if notice.issued_by != self.tracker_id:
            self._apply(notice)

    async def lift(self, req: UnquarantineRequest) -> QuarantineNotice:
        """The operator's lift; the reply says whether the node was in quarantine."""
        was = req.node_id in self.notices
        notice = QuarantineNotice(node_id=req.node_id, action="lift", issued_by=self.tracker_id,
                                  reason=f"lifted by {req.by}" if was else "was not in quarantine")
        self._apply(notice)
        if was:
            await self.bus.publish(subjects.QUARANTINE, notice)
            await self._store(notice)
        return notice

    def _apply(self, notice: QuarantineNotice) -> None:
        node = notice.node_id
        if notice.action == "quarantine":
            if node in self.notices:
                return
            self.notices[node] = notice
            log.warning("node %s quarantined: out of new routes (%s)", node, notice.reason)
        else:
            self.book.forget(node)
            if self.notices.pop(node, None) is None:
                return
            log.warning("node %s: quarantine lifted (%s)", node, notice.reason)
        self.on_change(node)

    async def _store(self, notice: QuarantineNotice) -> None:
        if self._kv is None:
            return
        try:
            if notice.action == "quarantine":
                await self._kv.put_json(notice.node_id, notice.model_dump(mode="json"))
            else:
                await self._kv.delete(notice.node_id)
        except Exception as exc:
            log.warning("quarantine bucket write for %s failed: %s", notice.node_id, exc)
