"""The quarantine evidence survives a tracker restart (issue 19): a starting tracker reads the
verdicts stored in MESH_AUDIT back, and a lift, kept in MESH_QUARANTINE with the audit sequence
it applies up to, still drops the evidence it dropped. A real nats-server, real trackers (in
process, stopped and started again), verdicts published as the validator's user publishes them.
`meshnet tracker unquarantine` reports the lift of every tracker that answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Callable

import pytest

from bus import subjects
from bus.client import Bus
from bus.jetstream import KeyValueStore
from bus.server import NatsServer
from schemas.audit import DIGEST_SCHEME, ValidationVerdict
from schemas.sampling import SamplingParams
from schemas.validation import QUARANTINE_BUCKET, QuarantineNotice, UnquarantineRequest
from tests.fixtures.nats import BusFactory
from tracker.main import build_unquarantine_parser, lift_lines, nothing_lifted, unquarantine
from tracker.service import Tracker, TrackerConfig

CONFIG = TrackerConfig(heartbeat_interval=0.1, expire_after=1.5, tick_interval=0.05, rebalance_interval=3600.0)
_n = itertools.count()


def verdict(outcome: str, *, implicated: tuple[str, ...] = (), cleared: tuple[str, ...] = ()) -> ValidationVerdict:
    i = next(_n)
    return ValidationVerdict(
        source="validator", validator_id="validator", session_id=f"s{i}", route_id=f"r{i}",
        validation_event_id=f"e{i}", model="smollm2", model_revision="rev", sampling=SamplingParams(seed=i),
        digest_scheme=DIGEST_SCHEME, prompt_digest="0" * 64, prompt_tokens=4, original_routes=[],
        replay_backend="llama.cpp", output_tokens=8, compared_tokens=8, original_output_digest="0" * 64, tolerance=1e-3,
        outcome=outcome, implicated=list(implicated), cleared=list(cleared),  # type: ignore[arg-type]
        blame_basis="hop_evidence")


def fail_a() -> ValidationVerdict:
    return verdict("fail", implicated=("head-a",))


def pass_b() -> ValidationVerdict:
    return verdict("pass", cleared=("head-b", "tail"))


async def tracker(bus_factory: BusFactory, tracker_id: str = "t") -> Tracker:
    """The tracker `tracker_id` on a fresh connection: each call is that tracker started again."""
    return Tracker(await bus_factory("tracker", name=tracker_id), dataclasses.replace(CONFIG, tracker_id=tracker_id))


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
        assert not first.quarantine.notices  # one failure is not enough
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


async def _unquarantine(nats_server: NatsServer, node_id: str, *flags: str) -> int:
    """`meshnet tracker unquarantine node_id` with the operator login of `nats_server`."""
    user, password = nats_server.credentials("operator")
    return await unquarantine(build_unquarantine_parser().parse_args(
        [node_id, "--nats", nats_server.url, "--nats-user", user, "--nats-password", password, *flags]))


async def test_unquarantine_reports_the_lift_of_every_tracker(
        nats_server: NatsServer, bus_factory: BusFactory, capsys: pytest.CaptureFixture[str]) -> None:
    validator = await bus_factory("validator")
    async with await tracker(bus_factory, "t1") as t1, await tracker(bus_factory, "t2") as t2:
        for v in (pass_b(), fail_a(), fail_a()):
            await validator.publish_audit(v)
        await until(lambda: t1.quarantine.holds("head-a") and t2.quarantine.holds("head-a"),
                    "head-a in quarantine at both trackers")
        assert await _unquarantine(nats_server, "head-a") == 0
        assert capsys.readouterr().out.splitlines() == [
            "tracker t1: head-a was in quarantine: lifted by operator",
            "tracker t2: head-a was in quarantine: lifted by operator"]
        assert not t1.quarantine.holds("head-a") and not t2.quarantine.holds("head-a")
        # again, or a mistyped node id: nothing to lift at either, and it says so and fails
        for node in ("head-a", "nosuchnode"):
            assert await _unquarantine(nats_server, node) == 1
            out, err = capsys.readouterr()
            assert out == "" and err.splitlines() == [
                f"meshnet tracker unquarantine: {node!r} is not in quarantine at any tracker (2 answered): "
                "nothing to lift (any evidence against it is dropped)"]
    started = time.monotonic()
    assert await _unquarantine(nats_server, "head-a", "--timeout", "3") == 1  # no tracker left
    assert "no tracker answered" in capsys.readouterr().err
    assert time.monotonic() - started < 3, "the server says at once that nobody serves the lift"


def test_a_lift_fails_only_when_no_tracker_had_the_node_in_quarantine() -> None:
    def lift(tracker_id: str, was: bool | None) -> QuarantineNotice:
        return QuarantineNotice(node_id="head-a", action="lift", reason="r", issued_by=tracker_id, was_quarantined=was)

    assert nothing_lifted("head-a", [lift("t1", True), lift("t2", False)]) is None  # one tracker lifted it
    assert nothing_lifted("head-a", [lift("t1", None)]) is None  # a tracker that does not say
    assert nothing_lifted("head-a", []) is None  # nobody answered: the command says that instead
    assert "not in quarantine at any tracker (2 answered)" in (
        nothing_lifted("head-a", [lift("t1", False), lift("t2", False)]) or "")
    assert lift_lines([lift("t1", True), lift("t2", False)])[1] == \
        "tracker t2: head-a was not in quarantine (its evidence is dropped)"
