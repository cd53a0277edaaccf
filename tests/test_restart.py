"""Node loss without losing the answer, against a real mesh: nats-server, tracker, gateway and
four node processes (two replicas of each half of the bundled model).

A session whose hop is SIGKILLed moves to a new route without that node, which prefills the
prompt and replays every token generated so far as one decode step each (the gateway's
default `--restart-replay auto` does so on these default-KV-profile nodes; tests/test_restart_exact.py
covers the batched replay of `--kv-profile exact` nodes), so its KV and logits are the lost route's, bit for bit:
the client's stream goes on from the next token and equals the uninterrupted answer, greedy
or seeded. The greedy test also states what replay by prefill would have given: llama.cpp's
own prefill of prompt + the k tokens generated (k from the `restarting` telemetry), and how
far its logits are from the step-by-step decode.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
import pytest_asyncio

from tests.test_concurrent_serving import PROMPTS, stream_chat
from tests.test_gateway_e2e import (
    Mesh,
    Reference,
    load_reference,
    read_sse,
    running_mesh,
    wait_routable,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

NODES = {"rs-head-a": "0:15", "rs-head-b": "0:15", "rs-tail-a": "15:30", "rs-tail-b": "15:30"}
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and a storm."}]
MAX_TOKENS = 96
SPREAD_TOKENS = 48


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    return load_reference(model_path)


def restart_mesh(model_path: Path, tmp: Path, nodes: dict[str, str],
                 node_flags: Sequence[str] = ()) -> AbstractAsyncContextManager[Mesh]:
    """A mesh of `nodes` (each started with `node_flags`) that expires a lost node in 3 s."""
    return running_mesh(model_path, tmp, dict(nodes), node_args={nid: (list(node_flags), {}) for nid in nodes},
                        node_timeout=3.0, keepalive=1.0, session_wait=600.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(model_path: Path, tmp_path_factory: pytest.TempPathFactory,
               reference: Reference) -> AsyncIterator[Mesh]:
    async with restart_mesh(model_path, tmp_path_factory.mktemp("restart-mesh"), NODES) as m:
        yield m


def resumed_by_prefill(ref: Reference, prompt: list[int], first: list[int], max_tokens: int,
                       ) -> tuple[list[int], float]:
    """Single-process llama.cpp resuming by prefill: greedy tokens after prefilling prompt +
    `first` in a fresh context (up to max_tokens in all, without EOG), and the max |diff|
    between that prefill's logits and the step-by-step decode's for the same position."""
    ref.llm.reset()
    ref.llm.eval(prompt)
    for token in first:
        ref.llm.eval([token])
    stepwise = ref.last_logits().copy()
    ref.llm.reset()
    ref.llm.eval([*prompt, *first])
    diff = float(np.abs(ref.last_logits() - stepwise).max())
    out = list(first)
    while len(out) < max_tokens:
        token = int(np.argmax(ref.last_logits()))
        if token in ref.eog:
            break
        out.append(token)
        ref.llm.eval([token])
    return out, diff


async def session_events(http: aiohttp.ClientSession, url: str, sid: str) -> list[dict[str, Any]]:
    async with http.get(f"{url}/v1/sessions/{sid}/events") as resp:
        return [orjson.loads(e["data"]) async for e in read_sse(resp) if e["data"].startswith("{")]


async def gateway_counter(http: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    """A counter of the gateway's /metrics by its label value ("" when it has none)."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            label = series.split('="', 1)[1].split('"', 1)[0] if "{" in series else ""
            out[label] = out.get(label, 0.0) + float(value)
    return out


async def route_nodes(http: aiohttp.ClientSession, url: str, sid: str) -> list[str]:
    while True:
        async with http.get(f"{url}/v1/sessions/{sid}") as resp:
            if resp.status == 200:
                nodes = (await resp.json())["route_nodes"]
                if nodes:
                    return nodes
        await asyncio.sleep(0.01)


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def every_node(mesh: Mesh) -> None:
    """Each test starts with two replicas of every range: the nodes an earlier test killed (or
    that died) are started again, so one failure does not cascade into the next tests."""
    gone = [nid for nid in NODES if nid not in mesh.nodes or mesh.nodes[nid].poll() is not None]
    for nid in gone:
        mesh.nodes.pop(nid, None)
        mesh.start_node(nid, NODES[nid])
    if gone:
        async with aiohttp.ClientSession() as http, asyncio.timeout(300):
            await wait_routable(mesh, set(NODES), http)


async def kill_mid_stream(mesh: Mesh, http: aiohttp.ClientSession, hop: int, sid: str,
                          body_extra: dict[str, Any], after_tokens: int = 12,
                          headers: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """Stream STORY, SIGKILL hop `hop` of its route once `after_tokens` arrived; the result and
    the killed node."""
    arrivals: list[float] = []
    task = asyncio.ensure_future(stream_chat(http, mesh.url, STORY, MAX_TOKENS, arrivals, sid=sid,
                                             extra=body_extra, headers=headers))
    victim = (await route_nodes(http, mesh.url, sid))[hop]
    async with asyncio.timeout(120):
        while len(arrivals) < after_tokens:
            assert not task.done(), task.result()
            await asyncio.sleep(0.005)
    mesh.kill_node(victim)
    async with asyncio.timeout(300):
        return await task, victim


async def test_killing_the_tail_mid_decode_continues_the_greedy_answer_on_a_new_route(
        mesh: Mesh, reference: Reference) -> None:
    prompt, uninterrupted, _ = reference.greedy(STORY, MAX_TOKENS)
    async with aiohttp.ClientSession() as http:
        out, victim = await kill_mid_stream(mesh, http, 1, "restart-tail", {"temperature": 0})
        events = await session_events(http, mesh.url, "restart-tail")
        assert out["error"] is None, out
        restarting = [e for e in events if e["phase"] == "restarting"]
        assert restarting, [e["phase"] for e in events]
        assert restarting[0]["lost_node_id"] == victim and restarting[0]["restarts"] == 1
        k = restarting[0]["generated_tokens"]
        final = events[-1]
        assert final["phase"] == "completed" and victim not in final["route_nodes"], final
        assert out["text"] == reference.llm.detokenize(uninterrupted).decode("utf-8", errors="replace")
        by_prefill, diff = resumed_by_prefill(reference, prompt, uninterrupted[:k], MAX_TOKENS)
        parted = next((j for j, (a, b) in enumerate(zip(by_prefill, uninterrupted, strict=False)) if a != b), None)
        print(f"restart after {k} tokens: the answer equals the uninterrupted run; resuming by "
              f"prefill instead, llama.cpp's logits differ from its decode by max |diff| {diff:.3f} "
              + ("and its greedy answer stays the same" if parted is None else f"and its answer parts at token {parted}"))
        async with http.get(f"{mesh.url}/metrics") as resp:
            assert 'meshnet_gateway_restarts_total{outcome="resumed"}' in await resp.text()


async def test_killing_the_head_mid_decode_continues_a_seeded_sampled_answer_exactly(mesh: Mesh) -> None:
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    async with aiohttp.ClientSession() as http:
        whole = await stream_chat(http, mesh.url, STORY, MAX_TOKENS, extra=sampled)
        assert whole["error"] is None, whole
        out, victim = await kill_mid_stream(mesh, http, 0, "restart-head", sampled)
        assert out["error"] is None, out
        assert out["text"] == whole["text"]  # the tail samples from (seed, position)
        events = await session_events(http, mesh.url, "restart-head")
        assert any(e["phase"] == "restarting" and e["lost_node_id"] == victim for e in events)


async def test_with_restart_off_a_lost_hop_is_the_structured_failure(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as http:
        out, _ = await kill_mid_stream(mesh, http, 1, "restart-off", {"temperature": 0},
                                            headers={"x-meshnet-restart": "off"})
        assert out["status"] == 200 and out["error"] is not None, out
        assert out["error"]["type"] == "route_failed" and "decode" in out["error"]["message"]
        events = await session_events(http, mesh.url, "restart-off")
        assert not any(e["phase"] == "restarting" for e in events)
        assert events[-1]["phase"] == "failed"


async def test_a_lost_node_fails_only_the_sessions_routed_through_it(mesh: Mesh, reference: Reference) -> None:
    """Eight sessions decode at once, restart off; half may use only one tail, half only the
    other (an allow list: which replica the cost model prefers is tests/test_tracker_routing.py's
    subject), the tracker picks their heads. SIGKILL one tail: exactly the sessions whose route
    held it get the structured failure, every other session finishes its uninterrupted answer,
    and every surviving hop frees every session's Hot KV State."""
    want = [reference.greedy(p, SPREAD_TOKENS)[2] for p in PROMPTS]
    sids = [f"spread-{k}" for k in range(len(PROMPTS))]
    arrivals: list[list[float]] = [[] for _ in PROMPTS]
    async with aiohttp.ClientSession() as http:
        tails = ["rs-tail-a", "rs-tail-b"]
        streams = [asyncio.ensure_future(stream_chat(http, mesh.url, p, SPREAD_TOKENS, arrivals[k], sid=sids[k],
                                                     headers={"x-meshnet-restart": "off",
                                                              "x-meshnet-route-policy": "private",
                                                              "x-meshnet-allow-nodes": f"rs-head-a,rs-head-b,{tails[k % 2]}"}))
                   for k, p in enumerate(PROMPTS)]
        routes = [await route_nodes(http, mesh.url, sid) for sid in sids]
        async with asyncio.timeout(300):
            while min(len(a) for a in arrivals) < 2:  # all eight are decoding
                assert not any(s.done() for s in streams), [s.result() for s in streams if s.done()]
                await asyncio.sleep(0.005)
        victim = routes[0][1]
        mesh.kill_node(victim)
        async with asyncio.timeout(300):
            results = await asyncio.gather(*streams)
        lost = {k for k, route in enumerate(routes) if victim in route}
        assert 0 < len(lost) < len(sids), routes  # the sessions were spread over the replicas
        for k, res in enumerate(results):
            if k in lost:
                assert res["status"] == 200 and res["error"] is not None, (k, res)
                assert res["error"]["type"] == "route_failed", (k, res["error"])
            else:
                assert res["error"] is None, (k, routes[k], res)
                assert res["text"] == want[k], (k, res["text"], want[k])
        survivors = {s.node_id: s.announcement.activation_url for s in mesh.tracker.registry if s.node_id != victim}
        assert len(survivors) == len(NODES) - 1, survivors
        async with asyncio.timeout(60):
            for url in survivors.values():
                while True:  # no session, cache or slot is left behind on a surviving hop
                    async with http.get(f"{url}/v1/sessions") as resp:
                        listing = await resp.json()
                    if not listing["live_sessions"] and listing["cache_bytes"] == 0 and listing["engine_sessions"] == 0:
                        break
                    await asyncio.sleep(0.1)
                assert listing["free_session_slots"] == listing["max_sessions"], listing


@pytest.mark.parametrize("hop", [0, 1], ids=["head", "tail"])
async def test_a_frozen_hop_is_left_for_a_new_route_and_frees_its_cache_when_it_wakes(
        mesh: Mesh, reference: Reference, hop: int) -> None:
    """SIGSTOP a hop mid-decode and leave it stopped: the stream must finish without it (the
    tracker expires it once its heartbeats stop, and its abort interrupts the gateway's
    route), with the uninterrupted greedy answer. Then SIGCONT: the hop holds nothing."""
    _, uninterrupted, _ = reference.greedy(STORY, MAX_TOKENS)
    sid = f"frozen-{hop}"
    async with aiohttp.ClientSession() as http:
        arrivals: list[float] = []
        stream = asyncio.ensure_future(stream_chat(http, mesh.url, STORY, MAX_TOKENS, arrivals, sid=sid))
        victim = (await route_nodes(http, mesh.url, sid))[hop]
        url = next(s.announcement.activation_url for s in mesh.tracker.registry if s.node_id == victim)
        async with asyncio.timeout(120):
            while len(arrivals) < 12:
                assert not stream.done(), stream.result()
                await asyncio.sleep(0.005)
        proc = mesh.nodes[victim]
        proc.send_signal(signal.SIGSTOP)
        frozen_at, seen = time.monotonic(), len(arrivals)
        try:
            async with asyncio.timeout(120):  # a hang guard: without detection it waits for SIGCONT
                res = await stream
        finally:
            proc.send_signal(signal.SIGCONT)
        assert res["error"] is None, res
        assert res["text"] == reference.llm.detokenize(uninterrupted).decode("utf-8", errors="replace")
        resumed = arrivals[seen] - frozen_at if len(arrivals) > seen else float("nan")
        print(f"frozen {('head', 'tail')[hop]}: next token {resumed:.2f} s after SIGSTOP")
        events = await session_events(http, mesh.url, sid)
        assert any(e["phase"] == "restarting" and e["lost_node_id"] == victim for e in events)
        async with asyncio.timeout(120):
            while True:  # awake again: the abort it slept through frees the session's cache
                async with http.get(f"{url}/v1/sessions") as resp:
                    listing = await resp.json()
                if not listing["live_sessions"] and listing["cache_bytes"] == 0 and listing["engine_sessions"] == 0:
                    break
                await asyncio.sleep(0.1)
        async with asyncio.timeout(120):
            await wait_routable(mesh, set(NODES), http)  # it announces again and serves


async def test_every_replica_lost_fails_after_the_bounded_restarts(mesh: Mesh) -> None:
    """Last in this module: it leaves the mesh without tails."""
    async with aiohttp.ClientSession() as http:
        sid = "restart-nowhere"
        nodes_task = asyncio.ensure_future(route_nodes(http, mesh.url, sid))
        stream = asyncio.ensure_future(stream_chat(http, mesh.url, STORY, MAX_TOKENS, [], sid=sid))
        tail = (await nodes_task)[1]
        other = next(n for n in NODES if NODES[n] == NODES[tail] and n != tail)
        mesh.kill_node(other)  # the only replacement goes first ...
        await asyncio.sleep(0.2)
        mesh.kill_node(tail)  # ... then the tail in use
        res = await stream
        assert res["error"] is not None, res
        assert "no new route" in res["error"]["message"] and "missing layers" in res["error"]["message"]
