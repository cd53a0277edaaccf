"""The Work Ledger: every audit event counted exactly once, across tracker and NATS restarts."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
from pathlib import Path

import pytest

from bus.jetstream import read_ledger
from bus.server import NatsServer
from gateway.route_client import RouteClient
from gateway.validation import validation_event
from nodes.server.session import claimed_decode_rows
from schemas.audit import NodeWork, RouteParticipation, SeedWork, ValidationEvent
from schemas.ledger import LedgerState, ledger_view
from schemas.route import Hop, RouteSession
from tests.fixtures.mesh import Mesh
from tests.fixtures.nats import BusFactory
from tests.test_speculative import COPY, EXACT, tokenize
from tracker.ledger import apply_event
from tracker.service import Tracker, TrackerConfig

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 60.0


def work(node: str, i: int, *, prefill: int = 10, decode: int = 5, active: int = 2_000_000_000,
         layers: tuple[int, int] = (0, 15)) -> NodeWork:
    return NodeWork(source=node, node_id=node, session_id=f"s{i}", route_id=f"r{i}", model_revision="rev",
                    layer_start=layers[0], layer_end=layers[1], prefill_tokens=prefill, decode_tokens=decode,
                    active_param_bytes=active)


def vouch(node: str, i: int, *, layers: tuple[int, int] = (0, 15), n_ctx: int = 2048) -> RouteParticipation:
    """The tracker's participation event for hop `node` of route r{i}: what makes its work count."""
    return RouteParticipation(source="tracker", session_id=f"s{i}", route_id=f"r{i}", model="m", model_revision="rev",
                              cache_abi="abi", node_id=node, layer_start=layers[0], layer_end=layers[1],
                              hop_index=0, n_hops=2, n_ctx=n_ctx)


TRACKER_SUBJECT = "mesh.audit.route_participation.tracker"
GATEWAY_SUBJECT = "mesh.audit.validation.gateway"


def counted(i: int, nodes: tuple[str, ...] = ("n",), *, prompt: int = 10, output: int = 5) -> ValidationEvent:
    """The gateway's validation event for route r{i} through `nodes`: `prompt` + `output` tokens."""
    hops = [Hop(node_id=n, activation_url="http://127.0.0.1:9", layer_start=0, layer_end=15) for n in nodes]
    session = RouteSession(session_id=f"s{i}", route_id=f"r{i}", model="m", model_revision="rev", cache_abi="abi",
                           n_layer=30, hidden_size=8, n_ctx=2048, hops=hops)
    return validation_event(session, prompt_ids=range(prompt), output_ids=range(output), finish_reason="stop")


def seed(node: str, i: int, nbytes: int = 1000, *, fetcher: str = "fetcher", corrupt: int = 0) -> SeedWork:
    """A fetcher's receipt for seeder `node`: `nbytes` of one verified piece, `corrupt` refused ones."""
    return SeedWork(source=fetcher, node_id=fetcher, seeder=node, artifact_id="a" * 32, bytes_served=nbytes,
                    pieces=1 if nbytes else 0, corrupt_pieces=corrupt, event_id=f"seed-{i:08d}")


def test_each_event_counts_once_and_a_heavier_shard_earns_more() -> None:
    s = LedgerState()
    for seq, (node, i) in enumerate([("heavy", 1), ("light", 2), ("light", 10)], start=1):
        apply_event(s, 2 * seq - 1, vouch(node, i).model_dump(mode="json"), subject=TRACKER_SUBJECT)
        apply_event(s, 2 * seq, counted(i, (node,)).model_dump(mode="json"), subject=GATEWAY_SUBJECT)
    heavy = work("heavy", 1, active=3_000_000_000).model_dump(mode="json")
    light = work("light", 2, active=1_000_000_000).model_dump(mode="json")
    assert apply_event(s, 11, heavy) and apply_event(s, 12, light)
    assert not apply_event(s, 12, light)  # the same sequence again: a redelivery
    assert not apply_event(s, 13, heavy)  # the same event id stored twice: a publisher's retry
    assert s.nodes["heavy"].prefill_work == 10 * 3.0 and s.nodes["heavy"].decode_work == 5 * 3.0
    assert s.nodes["light"].inference_work == 15 * 1.0 < s.nodes["heavy"].inference_work
    assert s.nodes["heavy"].prefill_layer_tokens == 150 and s.duplicates == 2
    # seeding stays in its own columns: a seed-only node earns no inference credit
    assert apply_event(s, 14, seed("seeder", 1, 5000).model_dump(mode="json"))
    acc = s.nodes["seeder"]
    assert (acc.seed_bytes, acc.seed_pieces, acc.inference_work, acc.sessions) == (5000, 1, 0.0, 0)
    # another party's report of a node's work does not count (the subject binds source to node)
    forged = {**work("light", 9).model_dump(mode="json"), "source": "gateway"}
    assert not apply_event(s, 15, forged)
    # a node publishing under its own subject a body that names another node, or nonsense
    theft = seed("light", 7, 10**12).model_dump(mode="json")
    assert not apply_event(s, 16, theft, subject="mesh.audit.seed.node.seeder")
    assert not apply_event(s, 17, {**work("light", 8).model_dump(mode="json"), "prefill_tokens": "many"})
    assert not apply_event(s, 18, {**seed("seeder", 9).model_dump(mode="json"), "bytes_served": -5})
    assert s.invalid == 4 and s.nodes["light"].seed_bytes == 0 and s.nodes["seeder"].seed_bytes == 5000
    assert apply_event(s, 19, work("light", 10).model_dump(mode="json"), subject="mesh.audit.node_work.node.light")
    assert [n["node_id"] for n in ledger_view(s)["nodes"]] == ["heavy", "light", "seeder"]


def test_seeding_is_credited_from_the_fetchers_verified_bytes_only() -> None:
    """A seeder that served corrupt pieces was once credited more than the honest one, from its
    own report. Now only a fetcher's receipt credits it, with the bytes that verified there."""
    s = LedgerState()
    assert apply_event(s, 1, seed("honest", 1, 5000).model_dump(mode="json"), subject="mesh.audit.seed.node.fetcher")
    assert apply_event(s, 2, seed("rotten", 2, 0, corrupt=3).model_dump(mode="json"),
                       subject="mesh.audit.seed.node.fetcher")
    # a seeder's report about itself, under its own subject: refused and counted against it
    own = seed("rotten", 3, 10**9, fetcher="rotten").model_dump(mode="json")
    assert not apply_event(s, 3, own, subject="mesh.audit.seed.node.rotten")
    # a receipt stored under another publisher than the fetcher it names
    assert not apply_event(s, 4, seed("rotten", 4, 10**9).model_dump(mode="json"), subject="mesh.audit.seed.node.rotten")
    honest, rotten = s.nodes["honest"], s.nodes["rotten"]
    assert (honest.seed_bytes, honest.seed_pieces, honest.seed_corrupt_pieces) == (5000, 1, 0)
    assert (rotten.seed_bytes, rotten.seed_pieces, rotten.seed_corrupt_pieces, rotten.refused_claims) == (0, 0, 3, 1)
    assert s.refused == 1 and s.invalid == 1


def test_only_work_a_tracker_vouched_for_counts_and_only_once() -> None:
    """A node with its own bus login once got 3e12 GB credited for sessions that never existed,
    on a range it does not serve, with 10^9 tokens. Now each claim needs the tracker's route
    participation for that route, node, range and session, and must fit the route's context."""
    s = LedgerState()
    assert not apply_event(s, 1, vouch("n", 1).model_dump(mode="json"), subject=TRACKER_SUBJECT)  # counts nothing itself
    assert not apply_event(s, 2, counted(1).model_dump(mode="json"), subject=GATEWAY_SUBJECT)  # nor does the count
    # a node's own participation report vouches for nothing
    assert not apply_event(s, 3, vouch("n", 2).model_dump(mode="json"), subject="mesh.audit.route_participation.node.n")
    assert not apply_event(s, 4, counted(2).model_dump(mode="json"), subject=GATEWAY_SUBJECT)
    assert not apply_event(s, 5, work("n", 99).model_dump(mode="json"))  # a session that never existed: waits, unpaid
    assert not apply_event(s, 6, work("n", 2).model_dump(mode="json"))  # vouched only by the node itself: the same
    assert not apply_event(s, 7, work("n", 1, layers=(15, 30)).model_dump(mode="json"))  # another range: refused
    assert not apply_event(s, 8, work("n", 1, prefill=10**9, decode=0).model_dump(mode="json"))  # beyond the context
    assert s.refused == 2 and s.nodes["n"].refused_claims == 2 and s.nodes["n"].inference_work == 0.0
    assert ledger_view(s)["unvouched_claims"] == 2
    assert apply_event(s, 10, work("n", 1).model_dump(mode="json"))  # the vouched one
    again = {**work("n", 1).model_dump(mode="json"), "event_id": "another-id"}
    assert not apply_event(s, 11, again)  # a vouch pays once: a second claim waits for a vouch that never comes
    assert s.nodes["n"].sessions == 1


def test_a_hop_is_paid_no_more_tokens_than_the_gateway_counted_for_its_session() -> None:
    """The gateway that drove a session counts its prompt and output tokens; no hop computes
    more rows than those. A claim within the route's context but beyond that count is refused
    and counted against the node; a count from anyone but the gateway vouches for nothing."""
    s = LedgerState()
    apply_event(s, 1, vouch("n", 1).model_dump(mode="json"), subject=TRACKER_SUBJECT)
    apply_event(s, 2, vouch("m", 1).model_dump(mode="json"), subject=TRACKER_SUBJECT)
    # a node's own "validation" event under its subject counts nothing: the claim waits
    assert not apply_event(s, 3, counted(1, ("n", "m"), prompt=10**3).model_dump(mode="json"),
                           subject="mesh.audit.validation.node.n")
    assert not apply_event(s, 4, work("n", 1, prefill=1000, decode=24).model_dump(mode="json"))
    assert s.refused == 0 and ledger_view(s)["unvouched_claims"] == 1
    # the gateway counted 10 + 5: the waiting claim of 1024 tokens is refused when the count comes
    assert not apply_event(s, 5, counted(1, ("n", "m")).model_dump(mode="json"), subject=GATEWAY_SUBJECT)
    assert (s.refused, s.nodes["n"].refused_claims, s.nodes["n"].sessions) == (1, 1, 0) and not s.unvouched
    # the other hop, within the count, is paid
    assert apply_event(s, 6, work("m", 1, prefill=10, decode=5).model_dump(mode="json"))
    assert s.nodes["m"].sessions == 1 and s.nodes["m"].prefill_tokens == 10
    # a restarted session: each route's hops are held to the session's count (prompt + output)
    apply_event(s, 7, vouch("n", 2).model_dump(mode="json"), subject=TRACKER_SUBJECT)
    assert not apply_event(s, 8, work("n", 2, prefill=12, decode=3).model_dump(mode="json"))  # waits for the count
    first = RouteSession(session_id="s0", route_id="r0", model="m", model_revision="rev", cache_abi="abi",
                         n_layer=30, hidden_size=8, n_ctx=2048, hops=counted(2).hops)
    second = first.model_copy(update={"route_id": "r2", "session_id": "s2"})
    event = validation_event(first, prompt_ids=range(10), output_ids=range(5), finish_reason="stop",
                             routes=[(first, 0), (second, 2)])
    assert apply_event(s, 9, event.model_dump(mode="json"), subject=GATEWAY_SUBJECT)  # pays the waiting claim
    assert s.nodes["n"].sessions == 1 and s.nodes["n"].prefill_tokens == 12


def test_a_claim_stored_before_its_vouch_is_paid_when_the_vouch_comes() -> None:
    """The tracker's participation and the gateway's count may reach the stream after the
    node's report (a short session, a slow publish): the claim waits for both."""
    s = LedgerState()
    assert not apply_event(s, 1, work("n", 5).model_dump(mode="json"))
    assert s.nodes["n"].sessions == 0 and ledger_view(s)["unvouched_claims"] == 1
    assert not apply_event(s, 2, vouch("n", 5).model_dump(mode="json"), subject=TRACKER_SUBJECT)
    assert s.nodes["n"].sessions == 0 and ledger_view(s)["unvouched_claims"] == 1
    assert apply_event(s, 3, counted(5).model_dump(mode="json"), subject=GATEWAY_SUBJECT)
    assert s.nodes["n"].sessions == 1 and s.nodes["n"].prefill_tokens == 10 and not s.unvouched


async def _wait_events(tracker: Tracker, n: int) -> None:
    async with asyncio.timeout(WAIT_S):
        for _ in itertools.count():
            if tracker.ledger is not None and tracker.ledger.state.events >= n:
                return
            await asyncio.sleep(0.05)


@pytest.mark.parametrize(("decode_rows", "decode_from", "decode_end", "used_rows", "claimed"), [
    (10, 32, 42, None, 10),  # no close said how many rows the answer used: every row booked
    (10, 32, 42, 35, 3),  # the head ran 7 steps past the answer (a stop string): those are not claimed
    (10, 32, 42, 50, 10),  # the answer used more than this hop computed (a restart's kept rows)
    (0, -1, 0, 35, 0),  # a session that never decoded
    (4, 32, 36, 30, 0),  # an answer that ended in the prompt's rows
    (5, 32, 40, 41, 8),  # a middle hop whose last verify step kept 3 drafts no next step showed it
    (6, 32, 45, 38, 6),  # a verify step's rejected drafts past the answer's rows
])
def test_a_hop_claims_its_decode_rows_below_the_rows_the_answer_used(
        decode_rows: int, decode_from: int, decode_end: int, used_rows: int | None, claimed: int) -> None:
    """By position, not by what is finished: a step still in flight when the close comes, or a
    verify step's rejected drafts, cannot push a claim past the answer's rows."""
    assert claimed_decode_rows(decode_rows, decode_from, decode_end, used_rows) == claimed


async def test_the_ledger_survives_tracker_and_nats_restarts_without_losing_or_double_counting(
        nats_server: NatsServer, bus_factory: BusFactory) -> None:
    node = await bus_factory("node", name="n1")
    fetcher = await bus_factory("node", name="f1")
    config = TrackerConfig(ledger=True)
    tbus, gbus = await bus_factory("tracker"), await bus_factory("gateway")
    for i in range(35):  # what the trackers' route requests and the gateway's sessions would have published
        await tbus.publish_audit(vouch("n1", i))
        await gbus.publish_audit(counted(i, ("n1",)))
    async with Tracker(tbus, config) as tracker:
        for i in range(20):
            await node.publish_audit(work("n1", i))
        await fetcher.publish_audit(seed("sd", 0, 4096, fetcher="f1"))
        await _wait_events(tracker, 21)
    # the tracker is gone: events go on being stored, and its durable consumer keeps its place
    for i in range(20, 30):
        await node.publish_audit(work("n1", i))
    async with Tracker(await bus_factory("tracker"), config) as tracker:
        await _wait_events(tracker, 31)
        assert tracker.ledger is not None and tracker.ledger.state.events == 31
    await nats_server.restart()  # the bucket and the stream are on disk
    for i in range(30, 35):
        await node.publish_audit(work("n1", i))
    async with Tracker(await bus_factory("tracker"), config) as tracker:
        await _wait_events(tracker, 36)
        await asyncio.sleep(0.5)  # nothing more arrives: nothing was counted twice
        state = tracker.ledger.state if tracker.ledger else None
    assert state is not None and state.events == 36
    acc = state.nodes["n1"]
    assert (acc.sessions, acc.prefill_tokens, acc.decode_tokens) == (35, 350, 175)
    assert abs(acc.inference_work - 35 * 15 * 2.0) < 1e-6
    assert state.nodes["sd"].seed_bytes == 4096 and state.nodes["sd"].inference_work == 0.0
    # readers: the stored value, and `meshnet ledger --json` as the monitor user
    stored = await read_ledger(await bus_factory("monitor"))
    assert stored.events == 36 and stored.last_seq == state.last_seq
    user, password = nats_server.credentials("monitor")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshnet.cli", "ledger", "--json", "--nats", nats_server.url, "--nats-user", user,
        "--nats-password", password, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    stdout, _ = await proc.communicate()
    assert proc.returncode == 0
    view = json.loads(stdout)
    assert {n["node_id"]: n["decode_tokens"] for n in view["nodes"]} == {"n1": 175, "sd": 0}


async def test_two_trackers_each_keep_a_whole_ledger_and_share_the_furthest(bus_factory: BusFactory) -> None:
    node = await bus_factory("node", name="n2")
    one = Tracker(await bus_factory("tracker"), TrackerConfig(ledger=True, tracker_id="t-one"))
    two = Tracker(await bus_factory("tracker"), TrackerConfig(ledger=True, tracker_id="t-two"))
    gateway = await bus_factory("gateway")
    async with one, two:
        for i in range(40):
            await one.bus.publish_audit(vouch("n2", i))
            await gateway.publish_audit(counted(i, ("n2",)))
            await node.publish_audit(work("n2", i))
        await _wait_events(one, 40)
        await _wait_events(two, 40)
        for t in (one, two):  # each counted everything once, and acknowledged it (after storing it)
            assert t.ledger is not None and t.ledger.state.nodes["n2"].sessions == 40
            async with asyncio.timeout(WAIT_S):
                while True:
                    info = await t.bus._js.consumer_info("MESH_AUDIT", t.ledger.durable)
                    if info.num_ack_pending == 0 and info.num_pending == 0:
                        break
                    await asyncio.sleep(0.05)
        monitor = await bus_factory("monitor")
        async with asyncio.timeout(WAIT_S):
            while (shared := await read_ledger(monitor)).events < 40:  # noqa: ASYNC110 - polling the bucket
                await asyncio.sleep(0.05)
        assert shared.nodes["n2"].sessions == 40  # one whole ledger, not a mix of two


async def test_a_real_routes_work_is_vouched_for_and_a_forged_claim_is_not(mesh: Mesh, bus_factory: BusFactory) -> None:
    """Real nodes and a real tracker: each hop of a route that ran is paid for what it computed,
    within what its driver (the gateway's login) counted; a node's claim for a session that never
    existed (its own bus login, its own subject) is refused and counted against it, and so are
    the hops' claims of a route whose driver counted fewer tokens than they say they computed."""
    head, tail = await mesh.spawn((0, 15)), await mesh.spawn((15, 30))
    ledger_tracker = Tracker(await bus_factory("tracker"), TrackerConfig(ledger=True, tracker_id="ledger-t"))
    async with ledger_tracker:
        for n_counted, base in ((32 + 2, 300), (8, 400)):  # the driver's count: prompt + 2 output tokens, then too few
            prompt = list(range(base, base + 32))  # not a shared prefix: each hop computes all 32 rows
            session = await mesh.route([head, tail])
            async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
                first = await rc.prefill(prompt)
                second = await rc.decode(first.token_id)
            await mesh.bus.publish_audit(validation_event(  # what the gateway records as the session ends
                session, prompt_ids=prompt[:n_counted - 2], output_ids=[first.token_id, second.token_id],
                finish_reason="length"))
        forger = await bus_factory("node", node_id=head.node_id)
        await forger.publish_audit(NodeWork(
            source=head.node_id, node_id=head.node_id, session_id="never", route_id="never", model_revision="x",
            layer_start=0, layer_end=30, prefill_tokens=10**9, decode_tokens=10**9, active_param_bytes=10**9))

        def settled() -> bool:
            s = ledger_tracker.ledger.state if ledger_tracker.ledger else None
            return s is not None and s.events >= 2 and s.refused >= 2 and bool(s.unvouched)

        async with asyncio.timeout(WAIT_S):
            while not settled():  # noqa: ASYNC110 - the ledger folds on its own schedule
                await asyncio.sleep(0.1)
        state = ledger_tracker.ledger.state  # type: ignore[union-attr]
    h, t = state.nodes[head.node_id], state.nodes[tail.node_id]
    assert (h.sessions, t.sessions) == (1, 1) and h.prefill_tokens == t.prefill_tokens == 32
    assert (h.refused_claims, t.refused_claims) == (1, 1)  # the second route: 33 rows claimed, 8 counted
    assert "never|" + head.node_id in state.unvouched  # the forged claim waits for a vouch that never comes
    assert h.inference_work == t.inference_work  # the same range's work, not 10^9 tokens' worth


async def _paid_or_refused(tracker: Tracker, claims: int) -> LedgerState:
    """The ledger once it paid `claims` claims or refused one (it folds on its own schedule)."""
    def settled() -> bool:
        s = tracker.ledger.state if tracker.ledger else None
        return s is not None and (s.events >= claims or s.refused > 0)

    async with asyncio.timeout(WAIT_S):
        while not settled():  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    return tracker.ledger.state  # type: ignore[union-attr]


class _ClientLeft(Exception):
    """The gateway's client left mid-answer: the route is aborted, not closed."""


@pytest.mark.parametrize(("ending", "draft"), [("close", 0), ("abort", 0), ("close", 8), ("unsaid", 0)])
async def test_a_driver_that_leaves_a_run_early_pays_its_hops_for_the_rows_its_answer_used(
        mesh: Mesh, bus_factory: BusFactory, ending: str, draft: int) -> None:
    """A gateway leaves a Decode Run at a stop string (a close) or because its client left (an
    abort), counting only the tokens it kept, while the head has run ahead (here it holds its
    tokens up to a second, `flush_ms`). The close or abort tells every hop the rows the answer
    used, and no hop claims more: both are paid, none refused. Before, each hop claimed every
    row it ran, more than the gateway counted, and was refused. With speculative decoding
    (`draft`) a hop's cache also held a verify step's rejected drafts, which it never claims.
    A route that ends before its driver said (a failure's abort: here the client ends it
    unasked) tells the hops the prompt and the tokens the client received."""
    args = EXACT if draft else ()
    head, tail = await mesh.spawn((0, 15), args=args), await mesh.spawn((15, 30), args=args)
    ledger_tracker = Tracker(await bus_factory("tracker"), TrackerConfig(ledger=True, tracker_id="ledger-t"))
    async with ledger_tracker:
        # not a shared prefix: each hop computes every row; a copy for speculation to draft from
        prompt = await asyncio.to_thread(tokenize, mesh.model_path, COPY) if draft else list(range(600, 632))
        session = await mesh.route([head, tail])
        with contextlib.suppress(_ClientLeft):
            async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
                first = await rc.prefill(prompt)
                kept = [first.token_id]
                async with contextlib.aclosing(rc.decode_run(first.token_id, 60, flush_ms=1000, draft=draft)) as run:
                    async for result in run:
                        kept.append(result.token_id)
                        if len(kept) == 3:  # the third token ends on a stop string, or the client leaves
                            break
                ran = (await mesh.session_stats(head, session.session_id))["decode_tokens"]
                if ending != "unsaid":
                    rc.used_rows = len(prompt) + len(kept)  # as gateway/generation.py does on leaving
                if ending in ("abort", "unsaid"):
                    raise _ClientLeft  # the route client aborts the route on its way out
        await mesh.bus.publish_audit(validation_event(session, prompt_ids=prompt, output_ids=kept,
                                                      finish_reason="stop"))
        state = await _paid_or_refused(ledger_tracker, 2)
    assert ran > len(kept)  # the head ran past what the gateway kept: the full claim would be refused
    h, t = state.nodes[head.node_id], state.nodes[tail.node_id]
    ends = [line for n in (head, tail) for line in n.log if session.session_id in line]  # how each hop ended it
    assert state.refused == 0 and (h.refused_claims, t.refused_claims) == (0, 0), ends
    assert h.prefill_tokens == t.prefill_tokens == len(prompt)
    assert h.decode_tokens == t.decode_tokens == len(kept)  # up to the gateway's count, no further


async def test_every_hop_of_a_speculative_route_is_paid_for_the_rows_of_its_answer(
        mesh: Mesh, bus_factory: BusFactory) -> None:
    """Three hops, a copy the head drafts from, a Decode Run that ends by itself. Every hop
    computed a row for each token but the last, and claims that: a middle hop books a verify
    step's kept drafts when the next step shows them, and the last step's (no next step) count
    by position. Before, the middle hop was short by them."""
    nodes = [await mesh.spawn(r, args=EXACT) for r in ((0, 10), (10, 20), (20, 30))]
    ledger_tracker = Tracker(await bus_factory("tracker"), TrackerConfig(ledger=True, tracker_id="ledger-t"))
    async with ledger_tracker:
        prompt = await asyncio.to_thread(tokenize, mesh.model_path, COPY)
        session = await mesh.route(nodes)
        async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
            first = await rc.prefill(prompt)
            results = [r async for r in rc.decode_run(first.token_id, 23, draft=8)]
        tokens = [first.token_id, *(r.token_id for r in results)]
        await mesh.bus.publish_audit(validation_event(session, prompt_ids=prompt, output_ids=tokens,
                                                      finish_reason="length"))
        state = await _paid_or_refused(ledger_tracker, 3)
    assert sum(r.accepted for r in results) > 0  # the drafts were kept: steps of several rows
    accounts = [state.nodes[n.node_id] for n in nodes]
    assert state.refused == 0 and all(a.prefill_tokens == len(prompt) for a in accounts)
    # a row for every token but the last (whose row no step computed), or also for the last
    # position when a rejected draft was computed there; never more than the gateway counted
    claimed = [a.decode_tokens for a in accounts]
    assert all(len(tokens) - 1 <= c <= len(tokens) for c in claimed), (claimed, len(tokens))


async def test_every_tracker_of_a_group_stores_its_route_participations(bus_factory: BusFactory) -> None:
    """The vouches the ledger pays by: a tracker named anything (`meshnet up --trackers 2` names
    them tracker-0, tracker-1) publishes them under its role, as the subject requires. Before,
    such a tracker's first participation was refused before sending and its publisher stopped."""
    from schemas.route import Hop, RouteSession

    hops = [Hop(node_id=n, activation_url="http://127.0.0.1:9", layer_start=a, layer_end=b)
            for n, (a, b) in {"h": (0, 15), "t": (15, 30)}.items()]
    session = RouteSession(session_id="grp", route_id="grp-r", model="m", model_revision="rev", cache_abi="abi",
                           n_layer=30, hidden_size=8, n_ctx=2048, hops=hops)
    tbus = await bus_factory("tracker")
    async with Tracker(tbus, TrackerConfig(tracker_id="tracker-1")) as tracker:
        tracker.audit.queue(session)
        tracker.audit.queue(session.model_copy(update={"route_id": "grp-r2", "session_id": "grp2"}))
        await tracker.audit.drained()
        assert (tracker.audit.published, tracker.audit.dropped) == (4, 0)
    stored = [m for m in await tbus.audit_messages() if m.get("kind") == "route_participation"]
    assert {(m["route_id"], m["node_id"]) for m in stored} >= {("grp-r", "h"), ("grp-r", "t"), ("grp-r2", "t")}


VALIDATOR_SUBJECT = "mesh.audit.validation_verdict.validator"


def replay_verdict(i: int, nodes: tuple[str, ...]) -> dict[str, object]:
    """The validator's verdict of session s{i}, replayed on route r{i} through `nodes`."""
    from schemas.audit import ValidationVerdict
    from schemas.sampling import SamplingParams

    return ValidationVerdict(
        source="validator", session_id=f"orig{i}", route_id=f"orig{i}", validator_id="v", validation_event_id="e" * 8,
        model="m", model_revision="rev", sampling=SamplingParams(), prompt_tokens=10, original_routes=[],
        replay_backend="route", replay_route_id=f"r{i}", replay_nodes=list(nodes), output_tokens=5,
        compared_tokens=5, tolerance=0.0, outcome="pass").model_dump(mode="json")


def test_a_validators_replay_routes_are_dropped_not_kept_until_refused() -> None:
    """At --validate-rate 1 every session is replayed on a route no gateway drove: its hops'
    claims waited for a gateway count that never came. The stored ledger (one value in the
    bucket, under NATS's 1 MB payload) passed 1 MB after ~800 replays, and past 10,000 waiting
    claims the oldest were refused against honest nodes. The verdict names its replay route:
    its claims and vouches go, whichever comes first, and a gateway's session is still paid."""
    import json as _json

    state, seq = LedgerState(), itertools.count(1)
    hops = (("a", (0, 15)), ("b", (15, 30)))
    for i in range(4000):
        late = i % 2 == 0  # half the claims are stored after the verdict
        for node, layers in hops:
            apply_event(state, next(seq), vouch(node, i, layers=layers).model_dump(mode="json"), TRACKER_SUBJECT)
            if not late:
                apply_event(state, next(seq), work(node, i, layers=layers).model_dump(mode="json"),
                            f"mesh.audit.node_work.node.{node}")
        apply_event(state, next(seq), replay_verdict(i, ("a", "b")), VALIDATOR_SUBJECT)
        for node, layers in hops if late else ():
            apply_event(state, next(seq), work(node, i, layers=layers).model_dump(mode="json"),
                        f"mesh.audit.node_work.node.{node}")
    assert not state.unvouched and not state.vouched and state.refused == 0
    assert len(_json.dumps(state.model_dump(mode="json"))) < 300_000
    assert all(acc.sessions == 0 and acc.refused_claims == 0 for acc in state.nodes.values())
    apply_event(state, next(seq), replay_verdict(9999, ("a",)), "mesh.audit.validation_verdict.node.a")
    assert "r9999" not in state.replays  # only the validator's word makes a route a replay
    apply_event(state, next(seq), vouch("a", 5000).model_dump(mode="json"), TRACKER_SUBJECT)
    apply_event(state, next(seq), counted(5000, ("a",)).model_dump(mode="json"), GATEWAY_SUBJECT)
    assert apply_event(state, next(seq), work("a", 5000).model_dump(mode="json"), "mesh.audit.node_work.node.a")
    assert state.nodes["a"].sessions == 1


def test_meshnet_ledger_says_the_claims_it_refused_per_node() -> None:
    """`meshnet ledger` printed only what was paid: a node whose claims were refused (it
    claimed more than the gateway counted) looked like any other unless one read --json."""
    from meshnet.ledger import render

    state, seq = LedgerState(), itertools.count(1)
    apply_event(state, next(seq), vouch("n", 1).model_dump(mode="json"), TRACKER_SUBJECT)
    apply_event(state, next(seq), counted(1, ("n",), prompt=2, output=1).model_dump(mode="json"), GATEWAY_SUBJECT)
    apply_event(state, next(seq), work("n", 1).model_dump(mode="json"), "mesh.audit.node_work.node.n")
    text = render(ledger_view(state))
    assert "1 claims refused" in text and "0 waiting for a vouch" in text
    row = next(line for line in text.splitlines() if line.startswith("n "))
    assert row.split()[-1] == "1"


def test_a_long_running_ledger_stays_within_the_buckets_value_size() -> None:
    """Each paid session leaves its route's count behind (kept up to 100,000), and a killed node's
    hops leave vouches no claim follows: some 40,000 sessions took the stored value past NATS's
    1 MB max_payload, and the ledger then stopped for good. The oldest of those records are
    trimmed instead; totals and the newest records stay, and a waiting claim goes last."""
    import orjson

    from tracker.ledger import STORED_MAX_BYTES, stored_value

    s = LedgerState()
    seq = itertools.count(1)
    s.counted = {f"old-route-{i:06d}": 15 for i in range(60_000)}  # sessions paid long ago
    s.vouched = {f"old-route-{i:06d}|killed": [f"s{i}", 0, 15, 2048] for i in range(5_000)}
    for i in range(1_000):  # then the newest sessions, paid as they end
        apply_event(s, next(seq), vouch("n", i).model_dump(mode="json"), subject=TRACKER_SUBJECT)
        apply_event(s, next(seq), counted(i).model_dump(mode="json"), subject=GATEWAY_SUBJECT)
        apply_event(s, next(seq), work("n", i).model_dump(mode="json"))
    apply_event(s, next(seq), work("n", 10**6).model_dump(mode="json"))  # a claim still waiting for its vouch
    assert len(orjson.dumps(s.model_dump(mode="json"))) > 1024 * 1024  # what NATS refused
    value = stored_value(s)
    assert len(orjson.dumps(value)) <= STORED_MAX_BYTES
    assert s.nodes["n"].sessions == 1_000 and s.refused == 0  # every total stays; the waiting claim too
    assert ledger_view(s)["unvouched_claims"] == 1
    assert "r999" in s.counted and "old-route-000000" not in s.counted  # the newest route counts stay
