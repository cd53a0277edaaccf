"""Fail fast on node loss: SIGKILL a hop mid-prefill or mid-decode; every survivor frees its cache.

A survivor of a loss in decode keeps its Hot KV State for `--restart-keep-s` (a restart may
continue on it: docs/shard-runtime.md, "Kept hops"; tests/test_restart_keep.py), here 1 s, and
then frees it; one in prefill (a restart never keeps it) frees it at once."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from gateway.route_client import RouteClient
from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import RouteFailedError
from tests.fixtures.mesh import Mesh, NodeProc


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, size=n).tolist()


async def run_other_route(mesh: Mesh, nodes: list[NodeProc], started: asyncio.Event, stop: asyncio.Event) -> int:
    """A concurrent session on a disjoint route: decode until told to stop; returns steps done."""
    session = await mesh.route(nodes)
    steps = 0
    async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
        tok = (await rc.prefill(prompt(40, 7))).token_id
        started.set()
        while not stop.is_set() or steps < 20:
            tok = (await rc.decode(tok)).token_id
            steps += 1
    return steps


KEEP_S = 1.0  # the survivors' --restart-keep-s
SURVIVOR_ARGS = ("--restart-keep-s", str(KEEP_S), "--reap-interval", "0.25")


async def assert_freed(mesh: Mesh, survivors: list[NodeProc], *, parked_ok: bool) -> None:
    """Every surviving hop of the failed session holds no live session, and no cache bytes
    either at once or (`parked_ok`: a loss in decode) once its keep window has passed."""
    for node in survivors:
        listing = await mesh.sessions(node)
        assert listing["sessions"] == [], (node.node_id, listing)
        if not parked_ok:
            assert listing["engine_sessions"] == 0 and listing["cache_bytes"] == 0, (node.node_id, listing)
            assert listing["parked"] == [], (node.node_id, listing)
    deadline = time.monotonic() + KEEP_S + 5.0
    for node in survivors:
        while True:
            listing = await mesh.sessions(node)
            if listing["engine_sessions"] == 0 and listing["cache_bytes"] == 0 and not listing["parked"]:
                break
            assert time.monotonic() < deadline, (node.node_id, listing)
            await asyncio.sleep(0.1)


async def kill_during(mesh: Mesh, layers: list[tuple[int, int]], victim: int, phase: str,
                      tail_delay_ms: int = 0, flush_ms: int = 0) -> tuple[RouteFailedError, float, list[NodeProc]]:
    env = {"MESHNET_TEST_DELAY_MS": str(tail_delay_ms)} if tail_delay_ms else None
    nodes = [await mesh.spawn(r, env=env if i == len(layers) - 1 else None, args=SURVIVOR_ARGS)
             for i, r in enumerate(layers)]
    others = [await mesh.spawn((0, 15)), await mesh.spawn((15, 30))]
    started, stop = asyncio.Event(), asyncio.Event()
    other = asyncio.create_task(run_other_route(mesh, others, started, stop))
    await started.wait()
    session = await mesh.route(nodes)
    killed_at = 0.0

    async def killer(wait_for: asyncio.Event) -> None:
        nonlocal killed_at
        await wait_for.wait()
        nodes[victim].kill()
        killed_at = time.monotonic()

    go = asyncio.Event()
    kill_task = asyncio.create_task(killer(go))
    with pytest.raises(RouteFailedError) as info:
        async with RouteClient(session, mesh.http, chunk_size=32, bus=mesh.bus) as rc:
            if phase == "prefill":
                await rc.prefill(prompt(1200), on_progress=lambda d, _t: go.set() if d >= 128 else None)
            elif phase == "run":  # a Decode Run: the head feeds itself, the caller only reads
                tok = (await rc.prefill(prompt(50))).token_id
                i = 0
                async for _ in rc.decode_run(tok, 3000, flush_ms=flush_ms):
                    i += 1
                    if i == 5:
                        go.set()
            else:
                tok = (await rc.prefill(prompt(50))).token_id
                for i in range(10_000):
                    if i == 5:
                        go.set()
                    tok = (await rc.decode(tok)).token_id
    elapsed = time.monotonic() - killed_at
    await kill_task
    stop.set()
    assert await other > 0  # the other route kept decoding, untouched
    survivors = [n for i, n in enumerate(nodes) if i != victim]
    await assert_freed(mesh, survivors, parked_ok=phase != "prefill")
    print(f"\n{phase}: killed hop {victim} of {len(nodes)}; failure after {elapsed * 1e3:.0f} ms: "
          f"{info.value.failure.model_dump()}")
    return info.value, elapsed, nodes


async def test_kill_tail_during_prefill(mesh: Mesh) -> None:
    err, _elapsed, nodes = await kill_during(mesh, [(0, 15), (15, 30)], 1, "prefill", tail_delay_ms=20)
    f = err.failure
    assert (f.phase, f.hop_index, f.node_id, f.code) == ("prefill", 1, nodes[1].node_id, "hop_lost")


async def test_kill_head_during_decode(mesh: Mesh) -> None:
    err, _elapsed, nodes = await kill_during(mesh, [(0, 15), (15, 30)], 0, "decode")
    f = err.failure
    assert (f.phase, f.hop_index, f.node_id, f.code) == ("decode", 0, nodes[0].node_id, "hop_lost")


async def test_kill_tail_during_a_batched_decode_run(mesh: Mesh) -> None:
    # tokens held for the next write when the tail dies go out first, then the failure
    err, _elapsed, nodes = await kill_during(mesh, [(0, 15), (15, 30)], 1, "run", flush_ms=200)
    f = err.failure
    assert (f.phase, f.hop_index, f.node_id, f.code) == ("decode", 1, nodes[1].node_id, "hop_lost")


async def test_kill_head_during_a_decode_run(mesh: Mesh) -> None:
    err, _elapsed, nodes = await kill_during(mesh, [(0, 15), (15, 30)], 0, "run")
    f = err.failure
    assert (f.phase, f.hop_index, f.node_id, f.code) == ("decode", 0, nodes[0].node_id, "hop_lost")


async def test_kill_middle_during_decode(mesh: Mesh) -> None:
    err, _elapsed, nodes = await kill_during(mesh, [(0, 10), (10, 20), (20, 30)], 1, "decode")
    f = err.failure
    assert (f.phase, f.hop_index, f.node_id, f.code) == ("decode", 1, nodes[1].node_id, "hop_lost")


async def test_kill_middle_during_a_decode_run(mesh: Mesh) -> None:
    # the head's lane to the middle breaks; the middle's own to the tail is let go
    err, _elapsed, nodes = await kill_during(mesh, [(0, 10), (10, 20), (20, 30)], 1, "run")
    f = err.failure
    assert (f.phase, f.hop_index, f.node_id, f.code) == ("decode", 1, nodes[1].node_id, "hop_lost")


async def test_idle_sessions_expire_after_their_lease(mesh: Mesh) -> None:
    args = ["--lease", "0.3", "--reap-interval", "0.1"]
    nodes = [await mesh.spawn((0, 15), args=args), await mesh.spawn((15, 30), args=args)]
    session = await mesh.route(nodes)
    rc = RouteClient(session, mesh.http, bus=None)  # a gateway that vanishes: never closes
    first = await rc.prefill(prompt(20))
    await asyncio.sleep(1.5)  # five leases with nothing sent
    for node in nodes:
        stats = await mesh.session_stats(node, session.session_id)
        assert stats["state"] == "expired" and stats["cache_bytes"] == 0
    with pytest.raises(RouteFailedError) as info:
        await rc.decode(first.token_id)
    assert info.value.failure.code == "session_closed" and info.value.failure.hop_index == 0


async def test_abort_while_a_final_frame_is_in_flight_answers_the_caller(mesh: Mesh) -> None:
    nodes = [await mesh.spawn((0, 15)), await mesh.spawn((15, 30), env={"MESHNET_TEST_DELAY_MS": "3000"})]
    session = await mesh.route(nodes)
    async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
        task = asyncio.create_task(rc.prefill(prompt(20)))
        for _ in range(600):  # until the tail holds the final frame
            if (await mesh.session_stats(nodes[1], session.session_id)).get("buffered") == 1:
                break
            await asyncio.sleep(0.01)
        url = f"{nodes[1].url}/v1/sessions/{session.session_id}"
        async with mesh.http.delete(url, params={"action": "abort", "reason": "test abort"},
                                    headers={CREDENTIAL_HEADER: session.credentials[1]}) as resp:
            assert (await resp.json())["ended"] is True
        with pytest.raises(RouteFailedError) as info:
            await task
    f = info.value.failure
    assert f.phase == "prefill" and f.code == "session_aborted" and "test abort" in f.reason
    await assert_freed(mesh, nodes, parked_ok=False)  # a plain abort frees at once


async def test_kill_tail_of_three_hops_during_a_decode_run(mesh: Mesh) -> None:
    # direct return: the head reads the tail's tokens on its Return Stream, which breaks; the
    # failure names the tail, whichever of the head and the middle sees the loss first
    err, _elapsed, nodes = await kill_during(mesh, [(0, 10), (10, 20), (20, 30)], 2, "run")
    f = err.failure
    assert (f.phase, f.hop_index, f.node_id, f.code) == ("decode", 2, nodes[2].node_id, "hop_lost")
