"""Blame from each node's own computation (issue 37, item 1), on a real mesh.

nats-server, the in-process tracker and gateway (every session sampled), the validator with the
llama.cpp reference, and four `meshnet node` processes on three hops: heads `m` and `s` [0, 10),
middle `w` [10, 20), tail `v` [20, 30). Chats use private routes, so each is judged on the
validator's reference, and every failure is pinned by checking each hop's rows.

- The probe's framing: `m` passes once while honest, restarts under the same id perturbing
  every row it sends, and fails twice on routes it shares with `w` and `v`. `m` is quarantined;
  `w` and `v` never are, and the restart inherited no trust from the earlier pass.
- A node that is right most of the time: `s` perturbs one session in three. Its passes clear
  nothing: two failures quarantine it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest_asyncio

from bus import subjects
from schemas.audit import ValidationVerdict
from schemas.validation import QuarantineNotice
from tests.test_gateway_e2e import Mesh, wait_routable
from tests.test_validation import validating_mesh
from validator.localize import ROW_TOLERANCE
from validator.service import Validator

GREETING = [{"role": "user", "content": "Name three colours of the rainbow."}]
FAULT = {"MESHNET_TESTING": "1"}


@pytest_asyncio.fixture
async def mesh(model_path: Path, tmp_path: Path) -> AsyncIterator[tuple[Mesh, Validator]]:
    nodes = {"m": "0:10", "s": "0:10", "w": "10:20", "v": "20:30"}
    async with validating_mesh(model_path, tmp_path, nodes, {"s": (["--fault", "perturb=0.01,every=3"], FAULT)}) as mv:
        yield mv


async def _chat(http: aiohttp.ClientSession, mesh: Mesh, allow: list[str]) -> None:
    body = {"model": "smollm2", "messages": GREETING, "max_tokens": 12, "temperature": 0,
            "route_policy": {"kind": "private", "allow_nodes": allow}}
    async with http.post(f"{mesh.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def _judged(validator: Validator, n: int) -> list[ValidationVerdict]:
    """Wait until the validator has judged `n` sessions in all (it judges one at a time)."""
    for _ in range(1200):
        if len(validator.verdicts) >= n:
            return validator.verdicts
        await asyncio.sleep(0.1)
    raise AssertionError(f"{len(validator.verdicts)} of {n} sessions judged: {validator.stats}")


def _head(v: ValidationVerdict) -> str:
    return v.original_routes[0].hops[0].node_id


async def test_blame_comes_from_each_hops_own_rows_not_from_elimination(
        mesh: tuple[Mesh, Validator], model_path: Path) -> None:
    m, validator = mesh
    notices: list[QuarantineNotice] = []
    async with aiohttp.ClientSession() as http, \
            m.monitor.subscribe(subjects.QUARANTINE, QuarantineNotice) as sub:
        collect = asyncio.create_task(_collect(sub, notices))
        try:
            # m passes once while honest
            await _chat(http, m, ["m", "w", "v"])
            first = await _judged(validator, 1)
            assert first[0].outcome == "pass" and set(first[0].cleared) == {"m", "w", "v"}, first[0].reason

            # m restarts under the same id with a fault, and fails twice with the same w and v
            m.kill_node("m")
            m.start_node("m", "0:10", "--fault", "perturb=0.01", env=FAULT)
            await wait_routable(m, {"m", "s", "w", "v"}, http)
            for _ in range(2):
                await _chat(http, m, ["m", "w", "v"])
            await _judged(validator, 3)

            # s is wrong one session in three: passes in between clear nothing
            for _ in range(6):
                await _chat(http, m, ["s", "w", "v"])
            verdicts = await _judged(validator, 9)
            for _ in range(100):
                if {n.node_id for n in notices} >= {"m", "s"}:
                    break
                await asyncio.sleep(0.1)
        finally:
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)

    for v in verdicts:
        print(f"{_head(v)}: {v.outcome}, implicated {v.implicated}: {v.reason}")
    outcomes = [(_head(v), v.outcome) for v in verdicts]
    assert outcomes == [("m", "pass"), ("m", "fail"), ("m", "fail"),
                        ("s", "pass"), ("s", "pass"), ("s", "fail"), ("s", "pass"), ("s", "pass"), ("s", "fail")]
    for v in verdicts:
        if v.outcome == "fail":
            assert v.implicated == [_head(v)] and set(v.cleared) == {"w", "v"} and v.blame_basis == "hop_evidence"
            # the honest hops' rows match their recomputation far inside the tolerance
            assert "w right" in v.reason and "v right" in v.reason, v.reason
    assert sorted(n.node_id for n in notices if n.action == "quarantine") == ["m", "s"]
    q = m.tracker.quarantine
    assert q.holds("m") and q.holds("s") and not q.holds("w") and not q.holds("v")
    assert ROW_TOLERANCE == 1e-3


async def _collect(sub: AsyncIterator[QuarantineNotice], into: list[QuarantineNotice]) -> None:
    async for notice in sub:
        into.append(notice)
