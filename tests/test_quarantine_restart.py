"""The quarantine evidence survives a tracker restart (issue 19): a starting tracker reads the
verdicts stored in MESH_AUDIT back, and a lift, kept in MESH_QUARANTINE with the audit sequence
it applies up to, still drops the evidence it dropped. A real nats-server, real trackers (in
process, stopped and started again), verdicts published as the validator's user publishes them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable

from bus import subjects
from bus.client import Bus
from bus.jetstream import KeyValueStore
from schemas.audit import ValidationVerdict
from schemas.sampling import SamplingParams
from schemas.validation import QUARANTINE_BUCKET, QuarantineNotice, UnquarantineRequest
from tests.fixtures.nats import BusFactory
from tracker.service import Tracker, TrackerConfig

CONFIG = TrackerConfig(heartbeat_interval=0.1, expire_after=1.5, tick_interval=0.05, rebalance_interval=3600.0)
_n = itertools.count()


def verdict(outcome: str, *, implicated: tuple[str, ...] = (), cleared: tuple[str, ...] = ()) -> ValidationVerdict:
    i = next(_n)
    return ValidationVerdict(
        source="validator", validator_id="validator", session_id=f"s{i}", route_id=f"r{i}",
        validation_event_id=f"e{i}", model="smollm2", model_revision="rev", sampling=SamplingParams(seed=i),
        prompt_sha256="0" * 64, prompt_tokens=4, original_routes=[], replay_backend="llama.cpp",
        output_tokens=8, compared_tokens=8, original_output_sha256="0" * 64, tolerance=1e-3,
        outcome=outcome, implicated=list(implicated), cleared=list(cleared))  # type: ignore[arg-type]


def fail_a() -> ValidationVerdict:
    return verdict("fail", implicated=("head-a", "tail"))


def pass_b() -> ValidationVerdict:
    return verdict("pass", cleared=("head-b", "tail"))


async def tracker(bus_factory: BusFactory) -> Tracker:
    """The tracker `t` on a fresh connection: each call is that tracker started again."""
    return Tracker(await bus_factory("tracker", name="t"), dataclasses.replace(CONFIG, tracker_id="t"))


async def until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        await asyncio.sleep(0.02)


async def publish(validator: Bus, t: Tracker, *verdicts: ValidationVerdict) -> None:
    """Store `verdicts` in MESH_AUDIT as the validator does, and wait until `t` has handled them."""
    for v in verdicts:
        await validator.publish_audit(v)
        await until(lambda v=v: v.event_id in {f.verdict_id for f in t.quarantine.book.verdicts},
                    f"tracker to read verdict {v.event_id}")


async def test_a_failure_before_a_tracker_restart_and_one_after_it_quarantine_the_node(
        bus_factory: BusFactory) -> None:
    validator, monitor = await bus_factory("validator"), await bus_factory("monitor")
    async with await tracker(bus_factory) as first:
        await publish(validator, first, pass_b(), fail_a())
        assert not first.quarantine.notices  # one singled-out failure is not enough
    async with await tracker(bus_factory) as again:
        assert len(again.quarantine.book.verdicts) == 2  # read back from the audit stream
        await publish(validator, again, fail_a())
        await until(lambda: again.quarantine.holds("head-a"), "head-a in quarantine after the restart")
        assert again.status().quarantined == ["head-a"]
        bucket = await KeyValueStore.open(again.bus, QUARANTINE_BUCKET, create=False)
        for _ in range(100):  # the bucket write follows the notice
            if ((await bucket.get_json("head-a")) or {}).get("action") == "quarantine":
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("head-a's quarantine never stored in the bucket")

    # started once more, it reads the quarantine from the bucket and announces nothing again
    async with monitor.subscribe(subjects.QUARANTINE, QuarantineNotice) as notices:
        await monitor.flush()
        async with await tracker(bus_factory) as third:
            assert third.quarantine.holds("head-a") and len(third.quarantine.book.verdicts) == 3
            try:
                notice: QuarantineNotice | None = await asyncio.wait_for(anext(aiter(notices)), timeout=1.0)
            except TimeoutError:
                notice = None
            assert notice is None, f"a second notice: {notice}"


async def test_a_node_lifted_before_a_restart_needs_two_new_failures(bus_factory: BusFactory) -> None:
    validator, operator = await bus_factory("validator"), await bus_factory("operator")
    async with await tracker(bus_factory) as first:
        await publish(validator, first, pass_b(), fail_a(), fail_a())
        await until(lambda: first.quarantine.holds("head-a"), "head-a in quarantine")
        lift = await operator.request(subjects.UNQUARANTINE, UnquarantineRequest(node_id="head-a"),
                                      QuarantineNotice, timeout=5.0)
        assert lift.action == "lift" and lift.audit_seq >= 3, lift
        assert not first.quarantine.holds("head-a")
    async with await tracker(bus_factory) as again:
        assert not again.quarantine.notices and again.status().quarantined == []  # the lift is no quarantine
        assert len(again.quarantine.book.verdicts) == 1  # the pass: the failures before the lift are dropped
        await publish(validator, again, fail_a())
        assert not again.quarantine.holds("head-a")
        await publish(validator, again, fail_a())
        await until(lambda: again.quarantine.holds("head-a"), "head-a in quarantine on two new failures")
