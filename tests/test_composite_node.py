"""A composite node: one `meshnet node` process serving two shards on one engine thread.

- turn_wait (pure): when a shard runs its batch, gives way, or waits for rows on their way;
- a real composite node of both halves of the real model (one process, each shard its own node
  id, port and bus user): 8 concurrent greedy sessions give llama.cpp's tokens, their decode
  steps ride one batch on each shard (EngineTurns merges sessions whose prompts ended at
  different times), and every session's KV is freed;
- a shard that cannot load stops the whole process with the error.
"""

from __future__ import annotations

import asyncio
import re
import sys
import uuid
from pathlib import Path

import pytest

from bus.credentials import NODE_CREDENTIALS_ENV, node_credentials_env
from nodes.composite import NodeProcess
from nodes.server.engine_turns import EngineTurns, turn_wait
from tests.fixtures.mesh import Mesh, NodeProc
from tests.test_decode_pipeline import _far_session
from tests.test_direct_return import prompts
from tests.test_route_exact import reference_greedy

TOKENS = 32


@pytest.mark.parametrize(("pending", "expected", "age", "older", "since", "wait"), [
    (8, 8, 0.0, True, 0.0, 0.0),  # every decoding session's row is in: now
    (3, 8, 0.3, True, 0.0, 0.0),  # the oldest row has waited long enough: now
    (3, 8, 0.01, True, 0.0, 0.24),  # another shard has older rows: give way (its call's end wakes us)
    (3, 8, 0.01, False, 0.001, 0.004),  # another shard's call just ended: its rows are on their way
    (3, 8, 0.01, False, 0.02, 0.0),  # long after it: nothing more is coming soon
    (1, 2, 0.0, False, float("inf"), 0.0),  # no other shard has run
])
def test_turn_wait(pending: int, expected: int, age: float, older: bool, since: float, wait: float) -> None:
    assert turn_wait(pending, expected, age, older, since, transit_s=0.005, max_defer_s=0.25) == pytest.approx(wait)


def test_engine_turns_sees_older_rows_and_wakes_the_others() -> None:
    oldest: list[float | None] = [None, None]
    woken: list[int] = []
    turns = EngineTurns()
    a = turns.join(lambda: oldest[0], lambda: woken.append(0))
    b = turns.join(lambda: oldest[1], lambda: woken.append(1))
    assert not turns.others_older(a) and turns.since_other_call(a, 5.0) == float("inf")
    oldest[:] = [2.0, 1.0]
    assert turns.others_older(a) and not turns.others_older(b)
    turns.ended(b)
    assert woken == [0] and turns.since_other_call(a, turns.shards[b].call_ended + 0.5) == pytest.approx(0.5)


async def test_a_composite_node_listens_once_every_shard_has_loaded() -> None:
    proc = NodeProcess(2)
    first = asyncio.create_task(proc.all_loaded())
    await asyncio.sleep(0)
    assert not first.done()  # the other shard is still loading
    assert await proc.all_loaded() and await first
    stopped = NodeProcess(2)
    waiting = asyncio.create_task(stopped.all_loaded())
    await asyncio.sleep(0)
    stopped.stop.set()  # the other shard failed: this one must not listen
    assert not await waiting


async def _shard(process: NodeProc, node_id: str, layers: tuple[int, int]) -> NodeProc:
    """One shard of a composite node process, once it prints where it serves."""
    shard = NodeProc(node_id, layers, process.proc)
    async with asyncio.timeout(120):
        while not shard.url:
            for line in process.log:
                if m := re.search(rf"meshnet node {node_id} serving .* at (http://\S+)", line):
                    shard.url = m.group(1)
            await asyncio.sleep(0.05)
    return shard


async def test_a_composite_node_serves_both_halves_in_one_process_and_batches_every_session(
        mesh: Mesh, model_path: Path) -> None:
    ps = await asyncio.to_thread(prompts, model_path)
    expected = await asyncio.to_thread(lambda: [reference_greedy(model_path, p, TOKENS) for p in ps])
    tail_id = f"tail-{uuid.uuid4().hex[:6]}"
    tail_user = await mesh.nats.add_node(tail_id)  # the tail shard's own bus user, as meshnet up hands it
    process = await mesh.spawn((0, 15), env={NODE_CREDENTIALS_ENV: node_credentials_env({tail_id: tail_user})},
                               args=["--layers", "15:30", "--node-id", tail_id, "--threads", "2"])
    head = await _shard(process, process.node_id, (0, 15))  # it printed the first shard ready, either one
    tail = await _shard(process, tail_id, (15, 30))
    assert tail.url != head.url
    lines = list(process.log)  # neither port opened before both shards had loaded
    loading = [i for i, line in enumerate(lines) if re.search(r"loading .* layers \[", line)]
    serving = [i for i, line in enumerate(lines) if "serving" in line]
    assert len(loading) == 2 and max(loading) < min(serving), lines
    together = asyncio.Barrier(len(ps))  # the runs decode at once, however the prefills were spread
    results = await asyncio.gather(*(_far_session(mesh, [head, tail], p, TOKENS, together=together) for p in ps))
    assert results == expected
    for node in (head, tail):
        listing = await mesh.sessions(node)
        assert listing["node_id"] == node.node_id, listing
        # every session's steps rode one batch: the shards took turns, none split them in groups
        assert listing["scheduler"]["max_sessions_in_batch"] == len(ps), listing["scheduler"]
        assert listing["engine_sessions"] == 0 and listing["cache_bytes"] == 0, listing


async def test_a_composite_node_whose_shard_cannot_load_exits_with_the_error(model_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nodes.main", "--model", str(model_path), "--layers", "0:15", "--layers", "15:31",
        "--no-bus", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2, out.decode()
    assert "15" in out.decode() and "31" in out.decode() and "Traceback" not in out.decode(), out.decode()


async def test_a_malformed_credential_table_is_a_clear_error(model_path: Path) -> None:
    import os

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nodes.main", "--model", str(model_path), "--layers", "0:15", "--layers", "15:30",
        "--no-bus", env={**os.environ, NODE_CREDENTIALS_ENV: '{"a": "not a user"'},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2 and NODE_CREDENTIALS_ENV in out.decode() and "Traceback" not in out.decode(), out
