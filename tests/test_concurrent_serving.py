"""Many users at once, against a real mesh: nats-server, tracker, two node processes, the gateway.

Each hop's scheduler runs the rows of every session it holds as one llama.cpp batch, so the
reference for concurrent greedy sessions is single-process llama.cpp decoding the same prompts
as one batch per step (llama-cpp-python's low-level batch API, one sequence id per prompt).

With a KV stream per sequence (the nodes' and the reference's layout), a session's logits
do not depend on which other sessions share its batch: the test also checks that the batched
reference equals each prompt decoded alone, bit for bit, so the mesh must match both exactly
whatever batches its hops formed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
import pytest_asyncio

from tests.fixtures.model import LLAMA_PROFILES
from tests.test_gateway_e2e import Mesh, Reference, load_reference, read_sse, running_mesh

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOPICS = ["the sea", "a mountain", "bread", "a violin", "winter", "a library", "rain", "a clock"]
PROMPTS = [[{"role": "user", "content": f"Write two sentences about {t}."}] for t in TOPICS]
MAX_TOKENS = 24
LONG_PROMPT_TOKENS = 2000


def batched_greedy(model_path: Path, prompts: list[list[int]], max_tokens: int, eog: set[int],
                   ) -> tuple[list[list[int]], list[list[np.ndarray]]]:
    """Greedy answers of single-process llama.cpp (the exact KV profile): each prompt prefilled on its own sequence,
    then every unfinished sequence decoded together, one batch per step. Returns the tokens
    (without EOG) and each generated token's logits."""
    from nodes.llama_ffi import import_llama_cpp

    ll = import_llama_cpp()
    model = ll.llama_model_load_from_file(str(model_path).encode(), ll.llama_model_default_params())
    cp = ll.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 512 * len(prompts), 512, 512, len(prompts)
    cp.kv_unified = False  # as the nodes: a KV stream per sequence
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED  # the exact KV profile, as the nodes run it
    cp.type_k = LLAMA_PROFILES["exact"]["type_k"]
    ctx = ll.llama_init_from_model(model, cp)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    batch = ll.llama_batch_init(512, 0, 1)

    def run(rows: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        for i, (seq, pos, tok, out) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, out
        batch.n_tokens = len(rows)
        assert ll.llama_decode(ctx, batch) == 0
        return [np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                for i, r in enumerate(rows) if r[3]]

    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[np.ndarray]] = [[] for _ in prompts]
    last: dict[int, np.ndarray] = {}
    for s, ids in enumerate(prompts):
        (last[s],) = run([(s, p, t, p == len(ids) - 1) for p, t in enumerate(ids)])
    try:
        while last:
            live = []
            for s, row in last.items():
                tok = int(row.argmax())
                if tok in eog:
                    continue
                tokens[s].append(tok)
                logits[s].append(row)
                if len(tokens[s]) < max_tokens:
                    live.append(s)
            if not live:
                break
            outs = run([(s, len(prompts[s]) + len(tokens[s]) - 1, tokens[s][-1], True) for s in live])
            last = dict(zip(live, outs, strict=True))
    finally:
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
        ll.llama_model_free(model)
    return tokens, logits


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    return load_reference(model_path, n_ctx=4096)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(model_path: Path, tmp_path_factory: pytest.TempPathFactory,
               reference: Reference) -> AsyncIterator[Mesh]:
    async with running_mesh(model_path, tmp_path_factory.mktemp("concurrent-mesh"),
                            {"cc-head": "0:15", "cc-tail": "15:30"}, node_timeout=3.0, keepalive=1.0,
                            session_wait=600.0) as m:
        yield m


async def stream_chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int,
                      arrivals: list[float] | None = None, sid: str | None = None,
                      extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One streaming chat completion (greedy unless `extra` body fields say otherwise); returns
    its text, usage, failure and token arrival times."""
    body = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    headers = {**({"x-route-session-id": sid} if sid else {}), **(headers or {})}
    out: dict[str, Any] = {"text": "", "usage": None, "error": None, "status": None}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        out["status"] = resp.status
        if resp.status != 200:
            out["error"] = await resp.json(content_type=None)
            return out
        async for event in read_sse(resp):
            if event["data"] == "[DONE]":
                break
            chunk = orjson.loads(event["data"])
            if "error" in chunk:
                out["error"] = chunk["error"]
                continue
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and arrivals is not None:
                    arrivals.append(time.monotonic())
                out["text"] += piece
    return out


async def tpot_buckets(http: aiohttp.ClientSession, url: str) -> dict[str, int]:
    """The gateway's time-per-output-token histogram: cumulative count per `le` bound."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    name = "meshnet_gateway_time_per_output_token_seconds_bucket"
    return {line.split('le="')[1].split('"')[0]: int(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(name)}


def detok(reference: Reference, ids: list[int]) -> str:
    return reference.llm.detokenize(ids).decode("utf-8", errors="replace")


async def node_sessions(http: aiohttp.ClientSession, mesh: Mesh) -> dict[str, Any]:
    """Each node's GET /v1/sessions, by node id (found through the tracker's registry)."""
    out = {}
    for state in mesh.tracker.registry:
        async with http.get(f"{state.announcement.activation_url}/v1/sessions") as resp:
            out[state.node_id] = await resp.json()
    return out


async def test_eight_concurrent_greedy_sessions_equal_llama_cpp_decoding_them_as_one_batch(
        mesh: Mesh, reference: Reference, capsys: pytest.CaptureFixture[str]) -> None:
    prompt_ids = [reference.prompt_ids(p) for p in PROMPTS]
    want, batch_logits = await asyncio.to_thread(batched_greedy, mesh.model_path, prompt_ids, MAX_TOKENS,
                                                 reference.eog)
    async with aiohttp.ClientSession() as http:
        tpot_before = await tpot_buckets(http, mesh.url)
        got = await asyncio.gather(*(stream_chat(http, mesh.url, p, MAX_TOKENS) for p in PROMPTS))
        hops = await node_sessions(http, mesh)
        tpot_after = await tpot_buckets(http, mesh.url)
    # time per output token: one sample per token after each answer's first, as generated by
    # the tail (a decode step takes milliseconds: none under 1 ms, though the head batches tokens)
    generated = sum(a["usage"]["completion_tokens"] for a in got)
    assert tpot_after["+Inf"] - tpot_before["+Inf"] == generated - len(got), (tpot_before, tpot_after)
    assert tpot_after["0.001"] == tpot_before["0.001"], (tpot_before, tpot_after)
    for k, (answer, ids) in enumerate(zip(got, want, strict=True)):
        assert answer["error"] is None, answer
        text = detok(reference, ids)
        assert answer["text"] == text, f"prompt {k}: {answer['text']!r} != {text!r}"
        assert answer["usage"]["completion_tokens"] == len(ids)
    # the hops really batched: some iteration carried rows of several sessions
    assert max(h["scheduler"]["max_sessions_in_batch"] for h in hops.values()) > 1, hops
    # how far batched logits are from each prompt decoded alone (stated in docs/benchmarks.md)
    def alone_diff(ids: list[int], logits: list[np.ndarray]) -> float:
        reference.llm.reset()
        reference.llm.eval(ids)
        alone = [reference.last_logits().copy()]
        for tok in [int(row.argmax()) for row in logits][:-1]:
            reference.llm.eval([tok])
            alone.append(reference.last_logits().copy())
        return max(float(np.abs(a - b).max()) for a, b in zip(alone, logits, strict=True))

    diffs = [await asyncio.to_thread(alone_diff, ids, logits)  # off the loop: the tracker lives on it
             for ids, logits in zip(prompt_ids, batch_logits, strict=True)]
    with capsys.disabled():
        print(f"\nbatched vs alone logits, max |diff| per prompt: {diffs}")
    assert max(diffs) == 0.0, diffs


async def test_decode_keeps_flowing_while_a_long_prompt_prefills(mesh: Mesh, reference: Reference) -> None:
    def long_prompt(n_items: int) -> list[dict[str, str]]:
        filler = " ".join(f"item{i}" for i in range(n_items))
        return [{"role": "user", "content": f"Here is a list: {filler}. What is the first item?"}]

    n_items = 400
    while len(reference.prompt_ids(long_prompt(n_items))) < LONG_PROMPT_TOKENS:
        n_items += 10
    long_messages = long_prompt(n_items)
    n_long = len(reference.prompt_ids(long_messages))
    assert LONG_PROMPT_TOKENS <= n_long < 2040, n_long  # within the nodes' 2048-token context
    arrivals: list[list[float]] = [[] for _ in range(4)]
    long_window: dict[str, float] = {}
    async with aiohttp.ClientSession() as http:
        decoders = [asyncio.ensure_future(stream_chat(http, mesh.url, PROMPTS[k] + [], 200, arrivals[k]))
                    for k in range(4)]
        while min(len(a) for a in arrivals) < 3:  # every decoder is streaming
            assert not any(d.done() for d in decoders), [d.result() for d in decoders if d.done()]
            await asyncio.sleep(0.01)
        long_arrivals: list[float] = []
        long_window["start"] = time.monotonic()
        long = await stream_chat(http, mesh.url, long_messages, 4, long_arrivals)
        long_window["first_token"] = long_arrivals[0] if long_arrivals else time.monotonic()
        results = await asyncio.gather(*decoders)
    assert long["error"] is None and long["usage"]["prompt_tokens"] == n_long, long
    for k, res in enumerate(results):
        assert res["error"] is None, res
        during = [t for t in arrivals[k] if long_window["start"] <= t <= long_window["first_token"]]
        # the long prompt's prefill took many scheduler iterations; each carried this stream's row
        assert len(during) >= 5, (k, len(during), long_window)


async def test_killing_a_node_while_eight_sessions_decode_fails_all_of_them_and_frees_the_head(
        mesh: Mesh) -> None:
    """Last in this module: it kills the tail."""
    arrivals: list[list[float]] = [[] for _ in PROMPTS]
    async with aiohttp.ClientSession() as http:
        streams = [asyncio.ensure_future(stream_chat(http, mesh.url, p, 400, arrivals[k]))
                   for k, p in enumerate(PROMPTS)]
        async with asyncio.timeout(300):
            while min(len(a) for a in arrivals) < 2:  # all eight are decoding
                assert not any(s.done() for s in streams), [s.result() for s in streams if s.done()]
                await asyncio.sleep(0.01)
        head_url = next(s.announcement.activation_url for s in mesh.tracker.registry if s.node_id == "cc-head")
        mesh.kill_node("cc-tail")
        results = await asyncio.gather(*streams)
        for res in results:
            assert res["status"] == 200 and res["error"] is not None, res
            assert "decode" in res["error"]["message"] or res["error"].get("code"), res["error"]
        async with asyncio.timeout(60):
            while True:  # the surviving hop frees every session's Hot KV State
                async with http.get(f"{head_url}/v1/sessions") as resp:
                    listing = await resp.json()
                if not listing["live_sessions"] and listing["cache_bytes"] == 0 and listing["engine_sessions"] == 0:
                    break
                await asyncio.sleep(0.1)
        assert listing["free_session_slots"] == listing["max_sessions"]
