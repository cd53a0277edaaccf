"""2-hop and 3-hop routes of real node processes give exactly the single-process greedy tokens,
with the default KV profile and with `--kv-profile exact` (against a reference loaded the same way)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gateway.route_client import RouteClient, plan_chunks
from tests.fixtures.mesh import Mesh
from tests.fixtures.model import LLAMA_PROFILES

N_GENERATE = 64
PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Explain in a few sentences why the sky is blue, and then list three colours "
    "of a rainbow.<|im_end|>\n<|im_start|>assistant\n"
)


def last_logits(llm) -> np.ndarray:
    """Logits of the last evaluated token of a llama_cpp.Llama (without logits_all)."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def reference_greedy(model_path: Path, prompt: list[int], n: int, profile: str = "exact") -> list[int]:
    """Greedy tokens of the whole model in one plain llama_cpp.Llama process loaded with the
    KV profile `profile`."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(model_path), n_ctx=1024, n_threads=2, verbose=False, **LLAMA_PROFILES[profile])
    try:
        llm.eval(prompt)
        out: list[int] = []
        for _ in range(n):
            tok = int(np.argmax(last_logits(llm)))
            out.append(tok)
            llm.eval([tok])
        return out
    finally:
        llm.close()


@pytest.fixture(scope="module")
def prompt_and_reference(model_path: Path) -> tuple[list[int], list[int]]:
    from llama_cpp import Llama

    tok = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    prompt = tok.tokenize(PROMPT.encode(), add_bos=False, special=True)
    return prompt, reference_greedy(model_path, prompt, N_GENERATE)


async def generate(mesh: Mesh, layers: list[tuple[int, int]], prompt: list[int], chunk: int,
                   mode: str = "run", node_args: tuple[str, ...] = ()) -> list[int]:
    """Prefill, then decode: one Decode Run (the head feeds itself) or a run of one step per token."""
    nodes = [await mesh.spawn(r, args=node_args) for r in layers]
    session = await mesh.route(nodes, prompt_tokens=len(prompt))
    progress: list[tuple[int, int]] = []
    async with RouteClient(session, mesh.http, chunk_size=chunk, bus=mesh.bus) as rc:
        first = await rc.prefill(prompt, on_progress=lambda d, t: progress.append((d, t)))
        tokens = [first.token_id]
        if mode == "run":
            tokens += [r.token_id async for r in rc.decode_run(first.token_id, N_GENERATE - 1)]
        while len(tokens) < N_GENERATE:
            tokens.append((await rc.decode(tokens[-1])).token_id)
        assert [t.node_id for t in first.timings] == [n.node_id for n in nodes]
    assert progress[-1] == (len(prompt), len(prompt))
    assert len(progress) == len(plan_chunks(len(prompt), chunk, ramp=True))  # ramped by default
    for node in nodes:  # close released every hop's cache
        listing = await mesh.sessions(node)
        assert listing["engine_sessions"] == 0 and listing["cache_bytes"] == 0
    await check_audited_work(mesh, session.session_id, nodes, len(prompt), N_GENERATE - 1)
    return tokens


async def check_audited_work(mesh: Mesh, session_id: str, nodes, n_prefill: int, n_decode: int) -> None:
    """Each hop reported its route participation and its work (tokens × its layers), once."""
    import asyncio

    for _ in range(100):  # audit events are published in the background when the session ends
        events = [e for e in await mesh.tracker.bus.audit_messages() if e.get("session_id") == session_id]
        work = {e["node_id"]: e for e in events if e["kind"] == "node_work"}
        joined = {e["node_id"] for e in events if e["kind"] == "route_participation" and e["source"] != "tracker"}
        if len(work) == len(nodes) and len(joined) == len(nodes):
            break
        await asyncio.sleep(0.1)
    assert set(work) == {n.node_id for n in nodes} and joined == set(work)
    for node in nodes:
        w = work[node.node_id]
        span = node.layers[1] - node.layers[0]
        assert (w["prefill_tokens"], w["decode_tokens"]) == (n_prefill, n_decode)
        assert w["work_units"] == (n_prefill + n_decode) * span


@pytest.mark.parametrize("mode", ["step", "run"])
async def test_two_hops_match_single_process(mesh: Mesh, prompt_and_reference, mode: str) -> None:
    prompt, reference = prompt_and_reference
    assert len(prompt) > 32
    tokens = await generate(mesh, [(0, 15), (15, 30)], prompt, chunk=16, mode=mode)
    assert tokens == reference


async def test_three_hops_match_single_process(mesh: Mesh, prompt_and_reference) -> None:
    prompt, reference = prompt_and_reference
    tokens = await generate(mesh, [(0, 9), (9, 20), (20, 30)], prompt, chunk=32, mode="run")
    assert tokens == reference


async def test_two_hops_match_single_process_under_the_exact_kv_profile(mesh: Mesh, model_path: Path,
                                                                        prompt_and_reference) -> None:
    prompt, default_reference = prompt_and_reference
    reference = reference_greedy(model_path, prompt, N_GENERATE)
    tokens = await generate(mesh, [(0, 15), (15, 30)], prompt, chunk=16, mode="run",
                            node_args=("--kv-profile", "exact"))
    assert tokens == reference
    parted = next((j for j, (a, b) in enumerate(zip(reference, default_reference, strict=True)) if a != b), None)
    print("the exact profile's greedy answer " + ("equals the default's" if parted is None
                                                  else f"parts from the default's at token {parted}"))
