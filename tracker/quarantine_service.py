"""Quarantine on the bus: verdicts in, notices out, the operator's lift, and the bucket.

Every tracker reads every verdict (mesh.audit.validation_verdict.validator: only the
validator's user may publish there) and decides the same way (tracker/quarantine.py). The
one that decides first publishes a QuarantineNotice on mesh.tracker.quarantine and stores it
in the MESH_QUARANTINE bucket; the others apply the notice as it comes. `meshnet tracker
unquarantine NODE` asks every tracker to lift one (operator credentials): the quarantine ends
and the evidence against the node is dropped; the bucket keeps the lift, with the audit stream
sequence it applies up to.

A tracker that starts reads the bucket (who is quarantined, and the lifts), then the last
HISTORY verdicts stored in MESH_AUDIT, less those a lift dropped, and decides again: evidence
gathered before a restart still counts, a node already quarantined gets no second notice, and
a lifted node is not quarantined again on the evidence its lift dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from bus import subjects
from bus.client import Bus, Responder, Subscription
from bus.jetstream import KeyValueStore, audit_last_seq, read_recent
from schemas.audit import ValidationVerdict
from schemas.validation import QUARANTINE_BUCKET, QuarantineNotice, UnquarantineRequest
from tracker.quarantine import (
    DEFAULT_MIN_FAILS,
    HISTORY,
    VerdictBook,
    VerdictFacts,
    decide,
    standing,
)

log = logging.getLogger("meshnet.tracker.quarantine")

VERDICT_SUBJECT = subjects.audit(subjects.VERDICT_KIND, "validator")
LIFT_SEQ_WAIT_S = 1.0  # the lift's look at the audit stream (the operator's command waits 5 s for the reply)


def verdict_facts(v: ValidationVerdict) -> VerdictFacts:
    """What the decision needs of a verdict, whether it came on the bus or from the stream: a
    blame that rests on a whole route (a verdict stored before hop evidence) implicates nobody."""
    return VerdictFacts(v.event_id, tuple(v.implicated) if v.blame_basis == "hop_evidence" else ())


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
        """Subscribe, read the bucket and the stored verdicts, answer lifts; returns each
        subscription with its handler, for the owner to consume (Tracker._consume)."""
        verdicts = await stack.enter_async_context(self.bus.subscribe(VERDICT_SUBJECT, ValidationVerdict))
        notices = await stack.enter_async_context(self.bus.subscribe(subjects.QUARANTINE, QuarantineNotice))
        lifted: dict[str, int] | None = None  # node -> audit sequence its last lift applies up to
        try:
            self._kv = await KeyValueStore.open(self.bus, QUARANTINE_BUCKET, create=True)
            lifted = {}
            for node_id, value in (await self._kv.items()).items():
                notice = QuarantineNotice.model_validate(value)
                if notice.action == "quarantine":
                    self.notices[node_id] = notice
                else:
                    lifted[node_id] = notice.audit_seq
        except Exception as exc:  # no JetStream yet: notices still arrive on the bus
            log.warning("quarantine bucket unavailable: %s", exc)
        if self.notices:
            log.warning("nodes in quarantine: %s", ", ".join(sorted(self.notices)))
        if lifted is not None:  # without the bucket it could not tell who is quarantined or lifted
            await self._rebuild(lifted)
        self._lift = await self.bus.serve(subjects.UNQUARANTINE, UnquarantineRequest, self.lift)
        return [(verdicts, self.on_verdict), (notices, self.on_notice)]

    async def stop(self) -> None:
        if self._lift is not None:
            await self._lift.stop()
            self._lift = None

    async def _rebuild(self, lifted: dict[str, int]) -> None:
        """Remember the last HISTORY stored verdicts that still count, and decide on them."""
        try:
            stored = await read_recent(self.bus, VERDICT_SUBJECT, HISTORY)
        except Exception as exc:  # the evidence then starts afresh, as it did before it was kept
            log.warning("stored verdicts unavailable: %s", exc)
            return
        facts = []
        for e in stored:
            try:
                facts.append((e.seq, verdict_facts(ValidationVerdict.model_validate(e.data))))
            except ValueError as exc:  # pydantic's ValidationError is one
                log.warning("stored verdict at audit sequence %d unreadable: %s", e.seq, exc)
        kept = standing(facts, lifted)
        for f in kept:
            self.book.add(f)
        log.info("read back %d stored verdict(s), %d still count", len(stored), len(kept))
        await self._decide()

    async def on_verdict(self, v: ValidationVerdict) -> None:
        if self.book.add(verdict_facts(v)):
            await self._decide()

    async def _decide(self) -> None:
        """Quarantine every node the remembered verdicts single out, and tell the others."""
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
        try:
            upto = await asyncio.wait_for(audit_last_seq(self.bus), LIFT_SEQ_WAIT_S)
        except Exception as exc:  # then a restart counts the verdicts before the lift again
            log.warning("audit stream unavailable for the lift of %s: %s", req.node_id, exc)
            upto = 0
        notice = QuarantineNotice(node_id=req.node_id, action="lift", issued_by=self.tracker_id, audit_seq=upto,
                                  reason=f"lifted by {req.by}" if was else "was not in quarantine",
                                  was_quarantined=was)
        self._apply(notice)
        if was:
            await self.bus.publish(subjects.QUARANTINE, notice)
        await self._store(notice)  # the evidence is dropped either way: so it stays after a restart
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
        """Keep the node's last notice: a quarantine, or a lift (a record, not a quarantine)."""
        if self._kv is None:
            return
        try:
            await self._kv.put_json(notice.node_id, notice.model_dump(mode="json"))
        except Exception as exc:
            log.warning("quarantine bucket write for %s failed: %s", notice.node_id, exc)
