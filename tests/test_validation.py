"""Replay validation and quarantine (issue 19): the pure decisions, then a real mesh in which a
perturbing node is caught by replay, quarantined, absent from the next routes, and lifted.

The mesh: nats-server, the in-process tracker, gateway (--validate-rate 1) and validator (the
llama.cpp whole-model reference), and three `meshnet node` processes: two heads [0, 15), one
of them started with `--fault perturb=0.01`, and one tail [15, 30).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio

from bus import subjects
from bus.client import Bus
from bus.errors import BusError
from bus.jetstream import KeyValueStore
from gateway.replay_vault import ReplayVault
from gateway.validation import in_sample, new_digest_salt, replayable_sampling, validation_event
from nodes.faults import FaultError, parse_fault, perturb_rows
from schemas.audit import (
    DIGEST_SCHEME,
    RouteTaken,
    ValidationEvent,
    ValidationVerdict,
    token_ids_digest,
)
from schemas.base import BusMessage
from schemas.route import Hop, RouteDirective, RouteSession
from schemas.sampling import SamplingParams
from schemas.validation import VERDICT_BUCKET, QuarantineNotice, ReplayRecord, ReplayRecordRequest
from tests.test_gateway_audit import unsalted_sha256
from tests.test_gateway_e2e import ROOT, Mesh, Reference, load_reference, running_mesh
from tracker.quarantine import VerdictBook, VerdictFacts, decide, standing
from validator.compare import (
    EXACT_TOLERANCE,
    Blame,
    Comparison,
    ForcedStep,
    Run,
    comparable,
    compare_runs,
    merge,
    rebuilt_exactly,
    routes_profile,
    score_forced,
)
from validator.evidence import evidence, record_matches
from validator.localize import HopCheck, SeamCheck, first_beyond, localize, row_errors
from validator.service import Validator

# -- pure decisions -------------------------------------------------------------------------


def test_identical_runs_pass_and_the_first_token_difference_fails() -> None:
    a = Run([1, 2, 3], [-0.1, -0.2, -0.3])
    assert compare_runs(a, Run([1, 2, 3], [-0.1, -0.2, -0.3]), EXACT_TOLERANCE).outcome == "pass"
    c = compare_runs(a, Run([1, 2, 9], [-0.1, -0.2, -0.3], [[], [], [(9, -0.3), (3, -2.0)]]), EXACT_TOLERANCE)
    assert (c.outcome, c.first_diff, c.compared) == ("fail", 2, 3)


def test_a_logprob_beyond_tolerance_fails_even_when_tokens_agree() -> None:
    c = compare_runs(Run([1, 2], [-0.1, -0.2]), Run([1, 2], [-0.1, -0.25]), EXACT_TOLERANCE)
    assert (c.outcome, c.first_diff) == ("fail", 1)
    assert c.max_logprob_diff == pytest.approx(0.0)


def test_a_near_tie_the_replay_also_saw_is_inconclusive_not_a_failure() -> None:
    c = compare_runs(Run([1, 5], [-0.1, -0.7000]), Run([1, 6], [-0.1, -0.6995], [[], [(6, -0.6995), (5, -0.7001)]]),
                     EXACT_TOLERANCE)
    assert c.tie and c.outcome == "inconclusive"


def test_a_replay_that_stops_early_fails_at_its_end_and_nothing_compared_is_inconclusive() -> None:
    assert compare_runs(Run([1, 2, 3], [None] * 3), Run([1, 2], [None] * 2), EXACT_TOLERANCE).first_diff == 2
    assert Comparison(0, None, None).outcome == "inconclusive"


def test_teacher_forced_scoring_checks_greedy_choice_and_logprob() -> None:
    run = Run([7, 8], [-0.5, -1.0])
    ok = [ForcedStep(-0.5, -0.5), ForcedStep(-1.0, -0.9995)]
    assert score_forced(run, ok, greedy=True, tolerance=1e-3).outcome == "pass"
    off_best = [ForcedStep(-0.5, -0.5), ForcedStep(-1.0, -0.2)]
    assert score_forced(run, off_best, greedy=True, tolerance=1e-3).first_diff == 1
    assert score_forced(run, off_best, greedy=False, tolerance=1e-3).outcome == "pass"  # sampled: not argmax
    assert score_forced(run, [ForcedStep(-0.4, -0.4)] * 2, greedy=False, tolerance=1e-3).first_diff == 0


def _route(rid: str, nodes: list[str], start: int = 0) -> RouteTaken:
    hops = [Hop(node_id=n, activation_url=f"http://127.0.0.1:{9000 + i}", layer_start=i, layer_end=i + 1)
            for i, n in enumerate(nodes)]
    return RouteTaken(session_id=f"s-{rid}", route_id=rid, epoch=1 if start == 0 else 2, hops=hops, from_token=start)


def test_a_failure_blames_the_hops_whose_own_rows_are_wrong_and_nobody_by_elimination() -> None:
    right, wrong = HopCheck("tail", 1, "right"), HopCheck("head-a", 0, "wrong", "position 3")
    agree = SeamCheck("head-a", "tail", True)
    blame, why = localize([wrong, right], [agree])
    assert (blame.implicated, blame.cleared) == (["head-a"], ["tail"]) and "head-a computed wrong rows" in why
    # a seam whose two accounts disagree implicates both ends (nothing says which one lies)
    blame, _ = localize([HopCheck("a", 0, "right"), right], [SeamCheck("a", "tail", False, "0.1 apart")])
    assert blame.implicated == ["a", "tail"] and blame.cleared == []
    # a hop without evidence carries the failure only when every other hop proved itself right
    blame, why = localize([HopCheck("a", 0, "unproven", "restarted"), right], [SeamCheck("a", "tail", None)])
    assert blame.implicated == ["a"] and blame.cleared == ["tail"] and "kept no evidence" in why
    blame, _ = localize([HopCheck("a", 0, "unproven"), HopCheck("b", 1, "wrong")], [SeamCheck("a", "b", None)])
    assert blame.implicated == ["b"]
    blame, why = localize([HopCheck("a", 0, "unproven"), HopCheck("b", 1, "unproven")], [SeamCheck("a", "b", None)])
    assert blame.implicated == [] and "nothing says which" in why
    blame, why = localize([HopCheck("a", 0, "right"), right], [SeamCheck("a", "tail", True)])
    assert blame.implicated == [] and "not any node's computation" in why
    assert merge(Blame(["a"], ["t"]), Blame([], ["a", "c"])) == Blame(["a"], ["t", "c"])


def test_row_errors_are_relative_per_position_and_nan_is_beyond_any_tolerance() -> None:
    base = np.ones((3, 4), np.float32)
    off = base.copy()
    off[1] *= 1.01
    off[2, 0] = np.nan
    errors = row_errors(off, base)
    assert errors[0] == 0 and abs(errors[1] - 0.01) < 1e-6
    assert first_beyond(errors, 1e-3) == 1 and first_beyond(errors[:1], 1e-3) is None
    assert first_beyond(np.array([0.0, np.nan]), 1.0) == 1


def test_only_hops_of_one_kv_profile_are_judged_by_a_replay_of_that_profile() -> None:
    default, exact = _route("r1", ["a", "b"]), _route("r2", ["c", "d"])
    exact = exact.model_copy(update={"hops": [h.model_copy(update={"kv_profile": "exact"}) for h in exact.hops]})
    mixed = default.model_copy(update={"hops": [default.hops[0], exact.hops[1]]})
    assert (routes_profile([default]), routes_profile([exact]), routes_profile([mixed])) == ("default", "exact", None)
    assert routes_profile([default, exact]) is None  # restarted onto another profile
    assert comparable("exact", "exact", "llama.cpp") and not comparable("exact", "default", "llama.cpp")
    assert not comparable(None, None, "route") and comparable("exact", "default", "torch")


def test_a_restart_rebuilt_in_one_batch_is_judged_only_on_exact_hops() -> None:
    def exact_route(route_id: str, nodes: list[str]) -> RouteTaken:
        r = _route(route_id, nodes)
        return r.model_copy(update={"hops": [h.model_copy(update={"kv_profile": "exact"}) for h in r.hops]})

    default, exact, exact_again = _route("r1", ["a", "b"]), exact_route("r2", ["c", "d"]), exact_route("r3", ["e", "f"])
    assert rebuilt_exactly("prefill", [default]) and rebuilt_exactly("decode", [default, default])
    assert rebuilt_exactly("auto", [exact, exact_again]) and rebuilt_exactly("prefill", [exact, exact_again])
    assert not rebuilt_exactly("auto", [default, default]) and not rebuilt_exactly("prefill", [exact, default])


async def test_a_reference_of_another_kv_profile_judges_nothing() -> None:
    class NoReplay:  # a reference that must not be asked
        backend, kv_profile = "llama.cpp", "default"

        def forced(self, *_args: object) -> None:
            raise AssertionError("a reference of another profile scored a session")

    route = _route("r1", ["a", "b"])
    route = route.model_copy(update={"hops": [h.model_copy(update={"kv_profile": "exact"}) for h in route.hops]})
    record = ReplayRecord(session_id="s1", digest_salt=new_digest_salt().hex(), prompt_ids=[1, 2, 3],
                          output_ids=[4, 5], output_logprobs=[-0.1, -0.2], routes=[route])
    v = Validator(None, reference=NoReplay(), route_replay=False)  # type: ignore[arg-type]
    j = await v._judge_record(record, [route], "rev")
    assert j.outcome == "inconclusive" and "KV profile exact" in j.reason and "--kv-profile" in j.reason


def test_quarantine_counts_the_failures_each_nodes_own_evidence_shows_and_passes_clear_nothing() -> None:
    bad1, bad2 = VerdictFacts("v1", ("head-a",)), VerdictFacts("v2", ("head-a",))
    decisions = decide([VerdictFacts("p0", ()), bad1, VerdictFacts("p1", ()), bad2])
    assert [d.node_id for d in decisions] == ["head-a"] and decisions[0].verdict_ids == ("v1", "v2")
    assert decide([bad1]) == []  # one failure is not enough
    assert decide([bad1, bad2], already=["head-a"]) == []
    # a seam dispute implicates both ends in that verdict: each is counted on its own
    assert [d.node_id for d in decide([VerdictFacts("s1", ("a", "b")), VerdictFacts("s2", ("a",))])] == ["a"]


def test_a_verdict_blaming_a_whole_route_implicates_nobody() -> None:
    from tracker.quarantine_service import verdict_facts

    route = _route("r1", ["a", "b"])
    v = ValidationVerdict(source="validator", validator_id="v", session_id="s", route_id="r1", validation_event_id="e", model="m",
                          model_revision="r", sampling=SamplingParams(), prompt_tokens=1, original_routes=[route],
                          replay_backend="llama.cpp", output_tokens=1, compared_tokens=1, tolerance=0.001,
                          outcome="fail", implicated=["a", "b"])
    assert verdict_facts(v).implicated == ()
    assert verdict_facts(v.model_copy(update={"blame_basis": "hop_evidence"})).implicated == ("a", "b")


def test_a_lift_forgets_the_evidence_and_a_redelivered_verdict_counts_once() -> None:
    book = VerdictBook()
    for v in (VerdictFacts("v1", ("a",)), VerdictFacts("v2", ("a",)), VerdictFacts("v3", ())):
        assert book.add(v)
    assert not book.add(VerdictFacts("v1", ("a",)))
    assert [d.node_id for d in decide(book.verdicts)] == ["a"]
    book.forget("a")
    assert decide(book.verdicts) == []


def test_sampling_for_validation_is_deterministic_and_about_the_rate() -> None:
    ids = [f"sess-{i}" for i in range(4000)]
    picked = [i for i in ids if in_sample(i, 0.05, b"k1")]
    assert picked == [i for i in ids if in_sample(i, 0.05, b"k1")]
    assert 140 <= len(picked) <= 260
    assert picked != [i for i in ids if in_sample(i, 0.05, b"k2")]  # keyed: a node cannot compute it
    assert not any(in_sample(i, 0.0, b"k") for i in ids[:50]) and all(in_sample(i, 1.0, b"k") for i in ids[:50])


def test_a_validated_session_gets_logprobs_and_a_seed_only_when_it_samples() -> None:
    greedy = replayable_sampling(SamplingParams(temperature=0.0), seed=7)
    assert greedy.logprobs and greedy.seed is None
    hot = replayable_sampling(SamplingParams(temperature=0.8), seed=7)
    assert hot.logprobs and hot.seed == 7
    assert replayable_sampling(SamplingParams(temperature=0.8, seed=3), seed=7).seed == 3


def test_the_vault_hands_a_record_out_once_and_bounds_count_and_age() -> None:
    now = [0.0]
    vault = ReplayVault(max_records=2, ttl_s=10.0, clock=lambda: now[0])
    for sid in ("a", "b", "c"):
        vault.keep(ReplayRecord(session_id=sid, digest_salt=new_digest_salt().hex(), prompt_ids=[1], output_ids=[2]))
    assert vault.take("a") is None and vault.dropped == 1  # pushed out
    assert vault.answer(ReplayRecordRequest(session_id="b", validator_id="v")) is not None
    assert vault.take("b") is None  # handed out once
    now[0] = 11.0
    assert vault.take("c") is None and len(vault) == 0  # too old


def test_digests_are_salted_and_the_validator_refuses_a_record_whose_ids_do_not_match() -> None:
    ids, prompt = [1, 2, 49151], [7, 8]
    a, b = new_digest_salt(), new_digest_salt()
    assert token_ids_digest(ids, a) != token_ids_digest(ids, b)  # the same ids under two salts
    assert token_ids_digest(ids, a) == hmac.new(a, struct.pack("<3I", *ids), hashlib.sha256).hexdigest()
    assert unsalted_sha256(ids) not in (token_ids_digest(ids, a), token_ids_digest(ids, b))
    with pytest.raises(ValueError, match="32 bytes"):
        token_ids_digest(ids, b"short")

    session = RouteSession(session_id="s", route_id="r", model="m", model_revision="rev", cache_abi="abi",
                           n_layer=30, hidden_size=576, n_ctx=256,
                           hops=[Hop(node_id="n1", activation_url="http://127.0.0.1:9", layer_start=0, layer_end=30)])
    event = validation_event(session, prompt_ids=prompt, output_ids=ids, finish_reason="stop", digest_salt=a)
    assert event.sampled and event.digest_scheme == DIGEST_SCHEME
    record = ReplayRecord(session_id="s", digest_salt=a.hex(), prompt_ids=prompt, output_ids=ids)
    assert record_matches(event, record)
    for wrong in ({"output_ids": [1, 2, 3]}, {"prompt_ids": [8, 7]}, {"digest_salt": b.hex()}):
        assert not record_matches(event, record.model_copy(update=wrong)), wrong
    plain = validation_event(session, prompt_ids=prompt, output_ids=ids, finish_reason="stop")
    assert not plain.sampled and (plain.digest_scheme, plain.prompt_digest, plain.output_digest) == (None,) * 3
    assert not record_matches(plain, record)  # no digests: nothing to check the ids against
    with pytest.raises(ValueError, match="come together"):  # a digest without its scheme
        ValidationEvent.model_validate({**plain.model_dump(), "prompt_digest": "ab" * 32})
    kept = evidence(record, Run([1, 2, 5], [-0.5, None, -1.0]))
    assert (kept["digest_scheme"], kept["digest_salt"], kept["replay_ids"]) == (DIGEST_SCHEME, a.hex(), [1, 2, 5])


def test_the_fault_switch_is_refused_outside_tests_and_checks_its_value() -> None:
    with pytest.raises(FaultError, match="MESHNET_TESTING"):
        parse_fault("perturb=0.01", env={})
    assert parse_fault("perturb=0.01", env={"MESHNET_TESTING": "1"}).sigma == 0.01
    assert parse_fault("perturb=0.01,every=3", env={"MESHNET_TESTING": "1"}).every == 3
    for bad in ("perturb", "perturb=x", "perturb=0", "flip=1", "perturb=0.01,every=0", "perturb=0.01,each=2"):
        with pytest.raises(FaultError):
            parse_fault(bad, env={"MESHNET_TESTING": "1"})
    rows = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32) * 3
    noisy = perturb_rows(rows, 0.01, np.random.default_rng(1))
    rel = np.sqrt(np.mean((noisy - rows) ** 2, axis=1)) / np.sqrt(np.mean(rows**2, axis=1))
    assert np.all((rel > 0.008) & (rel < 0.012)) and noisy.dtype == np.float32


def test_node_cli_refuses_the_fault_switch_without_the_testing_variable() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_TESTING"}
    proc = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--layers", "0:15", "--no-bus",
                           "--fault", "perturb=0.01"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "MESHNET_TESTING=1" in proc.stderr


def test_a_lift_drops_the_stored_verdicts_up_to_its_sequence_that_implicate_the_node() -> None:
    stored = [(3, VerdictFacts("f1", ("a", "t"))), (5, VerdictFacts("p1", ())),
              (7, VerdictFacts("f2", ("b", "t"))), (9, VerdictFacts("f3", ("a", "t")))]
    assert standing(stored, {}) == [f for _, f in stored]
    assert [f.verdict_id for f in standing(stored, {"a": 7})] == ["p1", "f2", "f3"]  # f3 came after the lift
    assert [f.verdict_id for f in standing(stored, {"a": 9, "b": 6})] == ["p1", "f2"]  # up to and with 9
    assert [f.verdict_id for f in standing(stored, {"t": 7})] == ["p1", "f3"]  # a pass implicates nobody


# -- a real mesh -----------------------------------------------------------------------------

GREETING = [{"role": "user", "content": "Name three colours of the rainbow."}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    ref = load_reference(model_path)
    ref.greedy(GREETING, MAX_TOKENS)
    return ref


@contextlib.asynccontextmanager
async def validating_mesh(model_path: Path, tmp: Path, nodes: dict[str, str],
                          node_args: dict[str, tuple[list[str], dict[str, str]]]) -> AsyncIterator[tuple[Mesh, Validator]]:
    """running_mesh with every session sampled, and a validator on the llama.cpp reference."""
    from validator.replay import Reference as ReplayReference

    async with running_mesh(model_path, tmp, nodes, node_args=node_args, validate_rate=1.0) as m:
        ref = await asyncio.to_thread(ReplayReference, "llama.cpp", model_path, 30)
        bus = await Bus.connect(m.nats.url, role="validator", name="validator")
        validator = Validator(bus, reference=ref)
        task = asyncio.create_task(validator.run())
        try:
            yield m, validator
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await bus.close()
            ref.close()


@pytest_asyncio.fixture
async def mesh(model_path: Path, tmp_path: Path) -> AsyncIterator[tuple[Mesh, Validator]]:
    faulty = (["--fault", "perturb=0.01"], {"MESHNET_TESTING": "1"})
    async with validating_mesh(model_path, tmp_path, {"head-a": "0:15", "head-b": "0:15", "tail": "15:30"},
                               {"head-a": faulty}) as mv:
        yield mv


async def _chat(http: aiohttp.ClientSession, mesh: Mesh, allow: list[str] | None = None) -> tuple[int, dict]:
    body: dict = {"model": "smollm2", "messages": GREETING, "max_tokens": MAX_TOKENS, "temperature": 0}
    if allow:
        body["route_policy"] = {"kind": "private", "allow_nodes": allow}
    async with http.post(f"{mesh.url}/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


async def test_a_perturbing_node_is_caught_by_replay_quarantined_and_lifted(
        mesh: tuple[Mesh, object], reference: Reference) -> None:
    m, validator = mesh
    _, _, expected = reference.greedy(GREETING, MAX_TOKENS)
    async with aiohttp.ClientSession() as http, \
            m.monitor.subscribe(subjects.QUARANTINE, QuarantineNotice) as notice_sub:
        notices = aiter(notice_sub)
        answers = {}
        for allow in (["head-a", "tail"], ["head-b", "tail"], ["head-a", "tail"], ["head-b", "tail"]):
            status, body = await _chat(http, m, allow)
            assert status == 200, body
            answers[allow[0]] = body["choices"][0]["message"]["content"]
        assert answers["head-b"] == expected  # the honest route
        notice = await asyncio.wait_for(notices.__anext__(), timeout=120)
        assert (notice.node_id, notice.action) == ("head-a", "quarantine"), notice
        assert m.tracker.quarantine.holds("head-a") and not m.tracker.quarantine.holds("head-b")

        verdicts: list[ValidationVerdict] = validator.verdicts  # type: ignore[attr-defined]
        by_head = {v.original_routes[0].hops[0].node_id: v for v in verdicts}
        bad, good = by_head["head-a"], by_head["head-b"]
        for v in (bad, good):
            print(f"verdict {v.outcome} on {v.replay_backend}: first_diff {v.first_diff}, "
                  f"max |dlogprob| {v.max_logprob_diff}, {v.elapsed_ms:.0f} ms: {v.reason}")
        assert bad.outcome == "fail" and "head-a" in bad.implicated and bad.replay_backend == "llama.cpp"
        assert good.outcome == "pass" and good.max_logprob_diff is not None and good.max_logprob_diff <= EXACT_TOLERANCE
        assert set(good.cleared) == {"head-b", "tail"} and bad.evidence_key

        # the next routes avoid it, and answer like the single-process model
        async with m.monitor.subscribe(subjects.DIRECTIVE_ALL, RouteDirective) as directive_sub:
            directives = aiter(directive_sub)
            for _ in range(3):
                status, body = await _chat(http, m)
                assert status == 200 and body["choices"][0]["message"]["content"] == expected
            opened = []
            while True:
                try:
                    d = await asyncio.wait_for(directives.__anext__(), timeout=1.0)
                except TimeoutError:
                    break
                if d.action == "open":
                    opened.append([h.node_id for h in d.session.hops])
        public = [hops for hops in opened if hops[0].startswith("head")]
        assert len(public) >= 3 and all("head-a" not in hops for hops in public), opened
        status, body = await _chat(http, m, ["head-a", "tail"])  # a private route through it: none left
        assert status == 503, body

        # the operator lifts it
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "meshnet.cli", "tracker", "unquarantine", "head-a", "--nats", m.nats.url,
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert "lifted" in out.decode()
        assert not m.tracker.quarantine.holds("head-a")
        status, _ = await _chat(http, m, ["head-a", "tail"])
        assert status == 200


async def test_only_the_validator_may_ask_the_gateway_for_a_sessions_ids(mesh: tuple[Mesh, object]) -> None:
    m, _ = mesh
    with pytest.raises(BusError):
        await m.monitor.request(subjects.REPLAY_RECORD, ReplayRecordRequest(session_id="x", validator_id="m"),
                                ReplayRecord, timeout=1.0)


async def test_an_honest_session_replays_on_a_route_with_no_node_in_common(
        model_path: Path, tmp_path: Path, reference: Reference) -> None:
    from validator.service import Validator

    nodes = {"head-a": "0:15", "head-b": "0:15", "tail-a": "15:30", "tail-b": "15:30"}
    prompt, output, expected = reference.greedy(GREETING, MAX_TOKENS)
    async with running_mesh(model_path, tmp_path, nodes, validate_rate=1.0) as m:
        bus = await Bus.connect(m.nats.url, role="validator", name="validator")
        validator = Validator(bus, reference=None)  # route replays only
        task = asyncio.create_task(validator.run())
        try:
            async with m.monitor.subscribe_any(subjects.AUDIT_ALL) as audit_sub:
                await m.monitor.flush()
                async with aiohttp.ClientSession() as http:
                    for _ in range(2):
                        status, body = await _chat(http, m)
                        assert status == 200 and body["choices"][0]["message"]["content"] == expected
                for _ in range(600):
                    if len(validator.verdicts) >= 2:
                        break
                    await asyncio.sleep(0.1)
                assert len(validator.verdicts) == 2, validator.stats
                seen = await _drain(audit_sub)
            for v in validator.verdicts:
                original = {h.node_id for r in v.original_routes for h in r.hops}
                assert v.outcome == "pass" and v.replay_backend == "route", v.reason
                assert len(v.replay_nodes) == 2 and not original & set(v.replay_nodes)
                assert v.compared_tokens == v.output_tokens == MAX_TOKENS
                assert v.digest_scheme == DIGEST_SCHEME and v.replay_output_digest == v.original_output_digest
                assert v.max_logprob_diff is not None and v.max_logprob_diff <= EXACT_TOLERANCE
                print(f"route replay {v.outcome}: {sorted(original)} vs {v.replay_nodes}, "
                      f"max |dlogprob| {v.max_logprob_diff}, {v.elapsed_ms:.0f} ms")
            assert not m.tracker.quarantine.notices
            await _check_salted(seen, validator.verdicts, m.tracker.bus, prompt, output)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await bus.close()


async def _drain(sub: AsyncIterator[BusMessage], quiet: float = 1.0, limit: int = 10_000) -> list[BusMessage]:
    """What `sub` received until it stays quiet for `quiet` s (at most `limit` messages)."""
    got: list[BusMessage] = []
    messages = aiter(sub)
    while len(got) < limit:
        try:
            got.append(await asyncio.wait_for(anext(messages), quiet))
        except TimeoutError:
            break
    return got


async def _check_salted(seen: list[BusMessage], verdicts: list[ValidationVerdict], reader: Bus,
                        prompt: list[int], output: list[int]) -> None:
    """No audit event the monitor saw carries an unsalted digest of the prompt or output ids, nor
    a salt, and each verdict's digests are reproducible from its evidence (ids and salt) in
    MESH_VERDICTS, which `reader` (the tracker's user) may read."""
    events = [m for m in seen if isinstance(m, ValidationEvent)]
    assert len(events) == 2 and all(e.sampled and e.digest_scheme == DIGEST_SCHEME for e in events), events
    assert {type(m).__name__ for m in seen} >= {"RouteParticipation", "NodeWork", "ValidationEvent",
                                                "ValidationVerdict"}
    published = [m.to_json() for m in seen]
    for plain in (unsalted_sha256(prompt), unsalted_sha256(output)):
        assert not any(plain.encode() in raw for raw in published), plain
    bucket = await KeyValueStore.open(reader, VERDICT_BUCKET, create=False)
    for v in verdicts:
        kept = await bucket.get_json(v.evidence_key)
        assert kept is not None and kept["original_ids"] == output, kept
        salt = bytes.fromhex(kept["digest_salt"])
        assert not any(kept["digest_salt"].encode() in raw for raw in published)
        assert (v.prompt_digest, v.original_output_digest, v.replay_output_digest) == (
            token_ids_digest(prompt, salt), token_ids_digest(output, salt), token_ids_digest(kept["replay_ids"], salt))


def test_a_constrained_greedy_token_is_judged_on_the_row_its_tail_chose_from(model_path: Path) -> None:
    """The forced scorer applies the session's constraint and penalties before it asks whether a
    greedy token was the best: an allowed token below a disallowed favourite is no failure."""
    from artifacts.vocab_file import materialize_vocabulary
    from nodes.token_constraint import vocabulary_of
    from schemas.output_constraint import OutputConstraint
    from validator.forced import ForcedScorer

    vocab = materialize_vocabulary(model_path)
    tok = vocabulary_of(str(vocab))
    sampling = SamplingParams(temperature=0, constraint=OutputConstraint(kind="json_object"))
    logits = np.zeros(tok.vocab_size, np.float32)
    favourite, brace = tok.tokenize_str("Hello")[0], tok.tokenize_str("{")[0]
    logits[favourite], logits[brace] = 9.0, 5.0
    step, own = ForcedScorer(sampling, vocab).step(logits, brace, 10)
    assert own == brace and step.best_logprob == step.logprob
    unconstrained, _ = ForcedScorer(SamplingParams(temperature=0), vocab).step(logits, brace, 10)
    assert unconstrained.best_logprob - unconstrained.logprob == pytest.approx(4.0)
    assert score_forced(Run([brace], [step.logprob]), [step], greedy=True, tolerance=EXACT_TOLERANCE).outcome == "pass"
    banned, _ = ForcedScorer(sampling, vocab).step(logits, favourite, 10)  # a token the constraint forbids
    assert score_forced(Run([favourite], [None]), [banned], greedy=True, tolerance=EXACT_TOLERANCE).outcome == "fail"


async def test_a_speculative_session_replays_to_a_pass(model_path: Path, tmp_path: Path) -> None:
    """Speculation changes how the route computed the tokens (verify steps, dropped drafts), not
    which: the replay on the exact reference passes, and every hop's evidence is its own rows."""
    from validator.replay import Reference as ReplayReference

    copy = [{"role": "user", "content": "Copy this text exactly: The lighthouse keeper climbed the stairs "
                                        "every evening at dusk, lit the great lamp, and watched the ships."}]
    exact = (["--kv-profile", "exact"], {})
    async with running_mesh(model_path, tmp_path, {"sv-head": "0:15", "sv-tail": "15:30"},
                            node_args={"sv-head": exact, "sv-tail": exact}, validate_rate=1.0) as m:
        ref = await asyncio.to_thread(ReplayReference, "llama.cpp", model_path, 30, kv_profile="exact")
        bus = await Bus.connect(m.nats.url, role="validator", name="validator")
        validator = Validator(bus, reference=ref)
        task = asyncio.create_task(validator.run())
        try:
            async with aiohttp.ClientSession() as http:
                body = {"model": "smollm2", "messages": copy, "max_tokens": 40, "temperature": 0}
                async with http.post(f"{m.url}/v1/chat/completions", json=body) as resp:
                    answer = await resp.json()
                    assert resp.status == 200, answer
            assert answer["usage"]["speculation"]["accepted_tokens"] > 0, answer["usage"]
            for _ in range(600):
                if validator.verdicts:
                    break
                await asyncio.sleep(0.1)
            (v,) = validator.verdicts
            assert v.outcome == "pass", v.reason
            assert set(v.cleared) == {"sv-head", "sv-tail"}, v
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await bus.close()
            ref.close()


async def test_a_session_restarted_by_a_batched_replay_on_exact_hops_is_judged(model_path: Path, tmp_path: Path) -> None:
    """On exact hops a restart's one-batch replay rebuilds the tokens with their own bits, so
    the validator judges the restarted session (a pass) instead of calling it inconclusive."""
    from tests.test_restart import kill_mid_stream
    from validator.replay import Reference as ReplayReference

    nodes = {"vr-head-a": "0:15", "vr-head-b": "0:15", "vr-tail-a": "15:30", "vr-tail-b": "15:30"}
    async with running_mesh(model_path, tmp_path, nodes, node_timeout=3.0, keepalive=1.0, session_wait=600.0,
                            validate_rate=1.0) as m:
        ref = await asyncio.to_thread(ReplayReference, "llama.cpp", model_path, 30)
        bus = await Bus.connect(m.nats.url, role="validator", name="validator")
        validator = Validator(bus, reference=ref)
        task = asyncio.create_task(validator.run())
        try:
            async with aiohttp.ClientSession() as http:
                out, victim = await kill_mid_stream(m, http, 1, "vr-restarted", {"temperature": 0}, after_tokens=24)
            assert out["error"] is None, out
            for _ in range(1200):  # the verdict comes from the validator's own task
                if validator.verdicts:
                    break
                await asyncio.sleep(0.1)
            (v,) = validator.verdicts
            assert len(v.original_routes) == 2 and victim in {h.node_id for h in v.original_routes[0].hops}, v
            assert v.outcome == "pass", v.reason
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await bus.close()
            ref.close()
