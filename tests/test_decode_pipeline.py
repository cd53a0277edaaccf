"""Decode pipelining (nodes/server/decode_pipeline.py): a hop with cores of its own runs its
decoding sessions in groups when their rows spend long away, so it computes one group while the
others travel; a composite node's shards (one engine thread) never split.

The pure rule and gauge are table-tested; the scheduler's batches are checked with a recording
engine (this is about scheduling; bench/wan.py measures it with real nodes over delayed links)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import numpy as np
import pytest

from gateway.route_client import RouteClient
from nodes.server.decode_pipeline import (
    MAX_GROUPS,
    PipelineGauge,
    decode_groups,
    group_sessions,
    next_groups,
)
from nodes.server.engine_turns import EngineTurns
from nodes.server.runner import EngineRunner
from nodes.server.scheduler import HopScheduler, PendingView, plan_batch
from tests.fixtures.mesh import Mesh, NodeProc
from tests.fixtures.wan import FarMesh
from tests.test_direct_return import prompts
from tests.test_hop_scheduler import ThreadRecordingEngine
from tests.test_route_exact import reference_greedy


@pytest.mark.parametrize("sessions,away,iteration,groups", [
    (8, 0.0, 0.04, 1),  # nothing measured yet
    (8, 0.09, 0.0, 1),
    (8, 0.01, 0.04, 1),  # the rows are back before another group could run: one batch
    (8, 0.04, 0.04, 2),  # RTT 0, two hops on their own cores: each computes while the other does
    (8, 0.09, 0.04, 3),  # 50 ms RTT: about (away + iteration) / iteration
    (8, 1.0, 0.01, MAX_GROUPS),
    (3, 1.0, 0.01, 1),  # too few sessions to split
    (5, 1.0, 0.01, 2),  # two sessions per group at least
])
def test_decode_groups(sessions: int, away: float, iteration: float, groups: int) -> None:
    assert decode_groups(sessions, away, iteration) == groups


@pytest.mark.parametrize("sessions,groups,per", [(8, 1, 8), (8, 2, 4), (8, 3, 3), (7, 2, 4), (1, 4, 1)])
def test_group_sessions(sessions: int, groups: int, per: int) -> None:
    assert group_sessions(sessions, groups) == per


@pytest.mark.parametrize("groups,bound,idle,queued,after", [
    (1, 4, 0.5, 0.2, 2),  # idle half the time, rows hardly wait: one group more
    (2, 4, 0.5, 0.2, 3),
    (4, 4, 0.5, 0.2, 4),  # never past the bound
    (3, 4, 0.1, 0.5, 3),  # busy, rows hardly wait: keep
    (3, 4, 0.0, 2.0, 2),  # rows wait two iterations: this hop is the bottleneck, one fewer
    (1, 4, 0.0, 2.0, 1),
    (3, 2, 0.0, 0.5, 2),  # the bound fell (the rows come back sooner)
])
def test_next_groups(groups: int, bound: int, idle: float, queued: float, after: int) -> None:
    assert next_groups(groups, bound, idle, queued) == after


def test_the_gauge_measures_time_away_and_iterations() -> None:
    gauge = PipelineGauge()
    gauge.back("a", 1.0)  # never left: no sample
    assert gauge.away_s == 0.0
    gauge.left("a", 1.0)
    gauge.back("a", 1.1)
    assert gauge.away_s == pytest.approx(0.1)
    gauge.left("a", 2.0)
    gauge.back("a", 2.2)
    assert 0.1 < gauge.away_s < 0.2  # a moving average
    gauge.left("gone", 3.0)
    gauge.back("gone", 30.0)  # away for long: it ended or restarted, not a sample
    assert gauge.away_s < 0.2
    assert gauge.per_iteration(8) == 8  # one group until a window has measured the hop


def test_a_hop_idle_between_iterations_takes_more_groups_up_to_the_bound() -> None:
    gauge = PipelineGauge()
    gauge.away_s = 0.12
    now = 10.0
    for _ in range(16):  # 0.05 s iterations, then 0.05 s idle: the rows are away
        gauge.waited(0.001)
        gauge.iteration(0.05, now, sessions=8)
        gauge.idle(now)
        now += 0.05
        gauge.busy(now)
        now += 0.05
    assert gauge.groups == 3  # up one per window, to round((0.12 + 0.05) / 0.05)
    assert gauge.per_iteration(8) == 3


def test_rows_that_queue_take_the_groups_back_down() -> None:
    gauge = PipelineGauge()
    gauge.away_s, gauge.groups = 0.3, 4
    now = 10.0
    for _ in range(12):  # never idle, and every row waited 3 iterations
        gauge.waited(0.15)
        gauge.iteration(0.05, now, sessions=32)
        now += 0.05
    assert gauge.groups == 3


def test_plan_batch_takes_a_group_of_decode_steps_oldest_first() -> None:
    pending = [PendingView(f"s{i}", 1) for i in range(5)] + [PendingView("r", 1, rebuild=True),
                                                               PendingView("p", 40)]
    plan = plan_batch(pending, max_rows=512, prefill_rows=64, mixed_prefill_rows=8, max_decode=2)
    # two decode steps, the rebuild's last row (urgent, never held for a group), a prompt's slice
    assert plan == [(0, 1), (1, 1), (5, 1), (6, 8)]


async def _group_batches(sched: HopScheduler, sessions: int) -> list[list[str]]:
    engine = sched.runner.engine
    for i in range(sessions):  # every session decoded once here and has been away since
        sched.pipeline.left(f"s{i}", 0.0)
    await asyncio.gather(*(sched.run(f"s{i}", 0, np.zeros(1, np.int32)) for i in range(sessions)))
    return [[s for s, _, _ in batch] for batch in engine.batches]


async def test_sessions_long_away_run_in_groups_on_cores_of_its_own() -> None:
    runner = await EngineRunner.load(ThreadRecordingEngine)  # type: ignore[arg-type]
    sched = HopScheduler(runner, expected=lambda: 8)
    sched.pipeline.away_s, sched.pipeline.iteration_s, sched.pipeline.groups = 0.09, 0.04, 3
    batches = await _group_batches(sched, 8)
    # oldest first, 3 groups' worth at first; each iteration here (no real model) is measured
    # shorter than 0.04 s, so the groups only get smaller
    assert batches[0] == ["s0", "s1", "s2"] and len(batches) >= 3
    assert [s for batch in batches for s in batch] == [f"s{i}" for i in range(8)]
    assert all(len(batch) <= 3 for batch in batches)
    await runner.close()


async def test_a_composite_nodes_shard_runs_every_session_at_once() -> None:
    """A composite node's shards share one engine thread: while one group travels, the other
    shards' calls hold the cores anyway, so a shard never splits its sessions."""
    runner = await EngineRunner.load(ThreadRecordingEngine)  # type: ignore[arg-type]
    sched = HopScheduler(runner, expected=lambda: 8, turns=EngineTurns())
    sched.pipeline.away_s, sched.pipeline.iteration_s, sched.pipeline.groups = 0.09, 0.04, 3
    batches = await _group_batches(sched, 8)
    assert batches == [[f"s{i}" for i in range(8)]]
    await runner.close()


FAR_LAYERS = [(0, 15), (15, 30)]
OWN_CORES = ("--threads", "1", "--batch-threads", "1")  # 2 node processes on 2 cores: a core each


async def test_eight_far_sessions_run_in_groups_and_give_llama_cpps_tokens(far_mesh: FarMesh,
                                                                          model_path: Path) -> None:
    """Real nodes 50 ms apart (RTT 100 ms), each with a core of its own: the hops split the 8
    decoding sessions into groups (their rows are away far longer than an iteration takes), and
    every session still gets llama.cpp's greedy tokens."""
    ps = await asyncio.to_thread(prompts, model_path)
    expected = await asyncio.to_thread(lambda: [reference_greedy(model_path, p, FAR_TOKENS) for p in ps])
    nodes = [await far_mesh.spawn(r, delay_s=0.05, args=OWN_CORES) for r in FAR_LAYERS]
    mesh = far_mesh.mesh
    # the runs start decoding together (a loaded machine may spread the prefills out): grouping
    # is about sessions decoding at once, not about how their prompts arrived
    together = asyncio.Barrier(len(ps))
    results = await asyncio.gather(*(_far_session(mesh, nodes, p, together=together) for p in ps))
    assert results == expected
    for node in nodes:
        listing = await mesh.sessions(node)
        sched = listing["scheduler"]
        assert sched["most_decode_groups"] >= 2, sched
        assert listing["engine_sessions"] == 0 and listing["cache_bytes"] == 0, listing


FAR_TOKENS = 24


async def _far_session(mesh: Mesh, nodes: list[NodeProc], prompt: list[int], tokens: int = FAR_TOKENS, *,
                       together: asyncio.Barrier | None = None) -> list[int]:
    """One session's greedy tokens; with `together`, its Decode Run waits for the others' prefills
    (a session that fails before breaks the barrier, so the others do not wait for it)."""
    async with contextlib.AsyncExitStack() as stack:
        try:
            session = await mesh.route(nodes, prompt_tokens=len(prompt))
            rc = await stack.enter_async_context(RouteClient(session, mesh.http, bus=mesh.bus))
            first = await rc.prefill(prompt)
        except BaseException:
            if together is not None:
                await together.abort()
            raise
        if together is not None:
            await together.wait()
        return [first.token_id] + [r.token_id async for r in rc.decode_run(first.token_id, tokens - 1)]
