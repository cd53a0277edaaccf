"""The gateway against a real mesh: nats-server, tracker, two node processes, the openai SDK.

Answers are compared with plain llama.cpp (greedy) on the bundled model, using the chat
template and token ids llama-cpp-python itself produces for the same messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import orjson
import pytest
import pytest_asyncio
from aiohttp import web

from bus import subjects
from bus.client import Bus
from bus.server import NatsServer, free_port
from gateway.app import create_app
from gateway.settings import GatewaySettings
from nodes.sampling import choose_token, shaped_logits, tempered_probs, token_rng
from schemas.node import NodeHeartbeat
from schemas.output_constraint import OutputConstraint, grammar_of
from schemas.route import RouteDirective
from schemas.sampling import SamplingParams
from schemas.telemetry import GenerationTelemetry
from tests.fixtures.llama_chain import llama_cpp_kept
from tests.fixtures.mesh import NODE_ENV
from tests.fixtures.model import LLAMA_PROFILES
from tracker.service import Tracker, TrackerConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = {"role": "system", "content": "You are a concise assistant."}
CAPITAL = [SYSTEM, {"role": "user", "content": "What is the capital of France? Answer briefly."}]
COUNT = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]


# -- the reference: plain llama.cpp, greedy ------------------------------------------------


@dataclass
class Reference:
    """Single-process llama.cpp on the whole model: template, token ids and greedy answers."""

    llm: Any
    eog: set[int]
    cache: dict[tuple[str, int], tuple[list[int], list[int], str]] = field(default_factory=dict)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids exactly as llama-cpp-python's Jinja2ChatFormatter + tokenize make them."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        meta = self.llm.metadata
        eos = self.llm._model.token_get_text(self.llm.token_eos())
        bos = self.llm._model.token_get_text(self.llm.token_bos())
        fmt = Jinja2ChatFormatter(template=meta["tokenizer.chat_template"], eos_token=eos,
                                  bos_token=bos)
        result = fmt(messages=messages)
        return self.llm.tokenize(result.prompt.encode(), add_bos=not result.added_special,
                                 special=True)

    def last_logits(self) -> np.ndarray:
        """Logits of the last evaluated position (llama.cpp keeps only that row)."""
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),))

    def greedy(self, messages: list[dict[str, str]], max_tokens: int,
               bias: dict[int, float] | None = None) -> tuple[list[int], list[int], str]:
        """(prompt ids, generated ids without EOG, text) for a greedy completion (with `bias`
        added to the logits, as a request's logit_bias)."""
        key = (orjson.dumps(messages).decode() + orjson.dumps(bias or {}, option=orjson.OPT_NON_STR_KEYS).decode(),
               max_tokens)
        if key not in self.cache:
            self.cache[key] = self.greedy_from(self.prompt_ids(messages), max_tokens, bias)
        return self.cache[key]  # every test's reference is computed by the fixture

    def greedy_from(self, prompt: list[int], max_tokens: int, bias: dict[int, float] | None = None,
                    shape: Callable[[np.ndarray, list[int]], np.ndarray] | None = None,
                    ) -> tuple[list[int], list[int], str]:
        """greedy() from prompt ids; `shape(logits, generated so far)` changes the row first."""
        self.llm.reset()
        self.llm.eval(prompt)
        out: list[int] = []
        while len(out) < max_tokens:
            logits = self.last_logits().copy()
            for t, b in (bias or {}).items():
                logits[t] += b
            if shape is not None:
                logits = shape(logits, out)
            token = int(np.argmax(logits))
            if token in self.eog:
                break
            out.append(token)
            self.llm.eval([token])
        text = self.llm.detokenize(out).decode("utf-8", errors="replace")
        return prompt, out, text


REFERENCE_RUNS = [(CAPITAL, 24), (COUNT, 40), (COUNT, 48)]


def load_reference(model_path: Path, n_ctx: int = 2048, profile: str = "exact") -> Reference:
    """Single-process llama.cpp on the whole model, loaded with the KV profile `profile`, with
    its end-of-generation ids."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=n_ctx, n_threads=2, verbose=False,
                          **LLAMA_PROFILES[profile])
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    eog = {t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    return Reference(llm, eog)


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    """Computed before the mesh starts, so it never competes with the nodes or blocks the loop."""
    ref = load_reference(model_path)
    for messages, max_tokens in REFERENCE_RUNS:
        ref.greedy(messages, max_tokens)
    return ref


# -- the mesh ------------------------------------------------------------------------------


@dataclass
class Mesh:
    nats: NatsServer
    tracker: Tracker
    monitor: Bus
    model_path: Path
    url: str
    nodes: dict[str, subprocess.Popen[bytes]]
    log_dir: Path

    def start_node(self, node_id: str, layers: str, *extra: str, env: dict[str, str] | None = None) -> None:
        """Start `meshnet node` for `layers` as a subprocess (1 thread: 2 nodes share 2 cores);
        `extra` flags and `env` variables are added to its command line and environment."""
        log = open(self.log_dir / f"{node_id}.log", "ab")  # owned by the process
        self.nodes[node_id] = subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli", "node", "--model", str(self.model_path),
             "--layers", layers, "--port", "0", "--nats", self.nats.url, "--node-id", node_id,
             "--threads", "1", "--log-level", "WARNING", *extra],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **NODE_ENV, **(env or {})},
        )

    def kill_node(self, node_id: str) -> None:
        """SIGKILL a node (no goodbye on the bus, sockets reset)."""
        proc = self.nodes.pop(node_id)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def openai(self) -> openai.AsyncOpenAI:
        """An async OpenAI SDK client for this gateway."""
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


async def _get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def _answers(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(f"{url}/healthz", timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def wait_routable(mesh: Mesh, node_ids: set[str], http: aiohttp.ClientSession) -> None:
    """Wait until the tracker knows exactly `node_ids`, each at an address that answers (a node
    killed and started again is known at its old one until it announces or expires) and each
    in its live map (a node a gateway reported lost stays out of routes until its next
    heartbeat), and the gateway's /healthz is 200."""
    while True:  # fails fast if a node process dies; otherwise waits as long as setup takes
        known = {s.node_id: s.announcement.activation_url for s in mesh.tracker.registry}
        status, body = await _get_json(http, f"{mesh.url}/healthz")
        if (set(known) == node_ids and node_ids <= set(mesh.tracker.book.live)
                and status == 200 and set(body["nodes"]) == node_ids
                and all([await _answers(http, url) for url in known.values()])):
            return
        for nid, proc in mesh.nodes.items():
            if proc.poll() is not None:
                raise RuntimeError(f"node {nid} exited: {(mesh.log_dir / f'{nid}.log').read_text()[-2000:]}")
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def running_mesh(model_path: Path, tmp: Path, nodes: dict[str, str], *,
                       node_args: dict[str, tuple[list[str], dict[str, str]]] | None = None,
                       **settings: Any) -> AsyncIterator[Mesh]:
    """nats-server, an in-process tracker and gateway (GatewaySettings `settings`), and one
    node process per {node_id: layers} (with `node_args[node_id]`: extra flags and environment);
    yields once the gateway can route; stops everything."""
    async with NatsServer.start(store_dir=tmp / "js") as srv:
        tracker_bus = await Bus.connect(srv.url, role="tracker", name="tracker")
        monitor = await Bus.connect(srv.url, role="monitor", name="monitor")
        async with Tracker(tracker_bus, TrackerConfig()) as tracker:
            port = free_port()
            runner = web.AppRunner(create_app(GatewaySettings(port=port, nats_url=srv.url, model=str(model_path),
                                                              **settings)))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            m = Mesh(srv, tracker, monitor, model_path, f"http://127.0.0.1:{port}", {}, tmp)
            for node_id, layers in nodes.items():
                flags, env = (node_args or {}).get(node_id, ([], {}))
                m.start_node(node_id, layers, *flags, env=env)
            try:
                async with aiohttp.ClientSession() as http:
                    await wait_routable(m, set(nodes), http)
                yield m
            finally:
                await runner.cleanup()
                for proc in m.nodes.values():
                    proc.terminate()
                for proc in m.nodes.values():
                    try:
                        proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        await monitor.close()
        await tracker_bus.close()


@contextlib.asynccontextmanager
async def far_running_mesh(model_path: Path, tmp: Path, nodes: dict[str, str], delay_s: float,
                           flags: tuple[str, ...] = (), **settings: Any) -> AsyncIterator[Mesh]:
    """running_mesh with every node behind its own DelayRelay (`delay_s` each way, advertised
    with --advertise, so every hop and the gateway reach it through the relay), each node
    started with `flags`."""
    from bench.relay import DelayRelay

    relays: list[DelayRelay] = []
    args: dict[str, tuple[list[str], dict[str, str]]] = {}
    try:
        for node_id in nodes:
            port = free_port()
            relay = DelayRelay("127.0.0.1", port, delay_s, None)
            await relay.start()
            relays.append(relay)
            args[node_id] = (["--port", str(port), "--advertise", f"http://127.0.0.1:{relay.port}", *flags], {})
        async with running_mesh(model_path, tmp, nodes, node_args=args, **settings) as m:
            yield m
    finally:
        for relay in relays:
            await relay.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(
    model_path: Path, tmp_path_factory: pytest.TempPathFactory, reference: Reference
) -> AsyncIterator[Mesh]:
    async with running_mesh(model_path, tmp_path_factory.mktemp("gateway-mesh"),
                            {"gw-head": "0:15", "gw-tail": "15:30"}, chunk_size=16, node_timeout=3.0,
                            decode_event_interval=0.02, keepalive=1.0, session_wait=600.0) as m:
        yield m


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def read_sse(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, str]]:
    """Parse an SSE byte stream into {"id", "event", "data"} dicts (comments skipped)."""
    fields: dict[str, str] = {}
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if "data" in fields:
                yield fields
            fields = {}
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            fields[name] = value[1:] if value.startswith(" ") else value


# -- correctness -----------------------------------------------------------------------------


async def test_models_and_health(mesh: Mesh, http: aiohttp.ClientSession) -> None:
    client = mesh.openai()
    models = await client.models.list()
    assert len(models.data) == 1
    status, body = await _get_json(http, f"{mesh.url}/healthz")
    assert status == 200 and body["model"] == models.data[0].id
    assert (await client.models.retrieve(models.data[0].id)).id == models.data[0].id
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")
    async with http.get(f"{mesh.url}/v1/chat/completions") as resp:  # a wrong method is the client's error
        err = (await resp.json())["error"]
        assert resp.status == 405 and err["type"] == "invalid_request_error", err


async def test_non_streaming_equals_llama_cpp(mesh: Mesh, reference: Reference) -> None:
    prompt, out, text = reference.greedy(CAPITAL, 24)
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=CAPITAL, max_tokens=24, temperature=0)
    resp = raw.parse()
    assert raw.headers["x-route-session-id"]
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == text
    assert choice.finish_reason == ("length" if len(out) == 24 else "stop")
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(out)
    assert resp.usage.total_tokens == len(prompt) + len(out)


async def test_a_finished_answer_closes_its_route_and_does_not_abort_it(mesh: Mesh) -> None:
    """An answer that ends by max_tokens or at the end of generation, streamed or not, releases
    its route with a close (the hops and the tracker book it as completed), never an abort."""
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    ids = [f"fin-{i}-{uuid.uuid4().hex[:6]}" for i in range(4)]
    actions: dict[str, str] = {}
    async with mesh.monitor.subscribe(subjects.DIRECTIVE_ALL, RouteDirective) as sub:
        for i, sid in enumerate(ids):
            kw: dict[str, Any] = {"max_tokens": 3 if i % 2 else 64, "temperature": 0,
                                  "extra_headers": {"x-route-session-id": sid}}
            if i < 2:
                await client.chat.completions.create(model=model, messages=CAPITAL, **kw)
            else:
                async for _ in await client.chat.completions.create(model=model, messages=CAPITAL, stream=True, **kw):
                    pass
        async with asyncio.timeout(30):
            async for d in sub:
                if d.issued_by == "gateway" and d.session.session_id in ids:
                    actions[d.session.session_id] = d.action
                    if len(actions) == len(ids):
                        break
    assert actions == dict.fromkeys(ids, "close"), actions


async def test_streaming_equals_llama_cpp_with_usage(mesh: Mesh, reference: Reference) -> None:
    prompt, out, text = reference.greedy(COUNT, 40)
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    stream = await client.chat.completions.create(
        model=model, messages=COUNT, max_completion_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length" if len(out) == 40 else "stop"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(prompt), len(out))
    assert len({c.id for c in chunks}) == 1

    plain = await client.chat.completions.create(
        model=model, messages=COUNT, max_tokens=40, temperature=0, stream=True)
    plain_chunks = [c async for c in plain]
    assert all(c.usage is None and c.choices for c in plain_chunks)
    assert "".join(c.choices[0].delta.content or "" for c in plain_chunks) == text


# what llama-server's web UI sends with its default settings but `temperature` (tools/server/webui:
# settings-config.ts and its chat service), and `typical_p`/`cache_prompt` as its older UI did
WEB_UI_BODY: dict[str, Any] = {
    "stream": True, "max_tokens": -1, "temperature": 0, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
    "samplers": ["top_k", "typ_p", "top_p", "min_p", "temperature"], "backend_sampling": False,
    "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1, "typ_p": 1.0,
    "typical_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1, "mirostat": 0,
    "cache_prompt": True, "timings_per_token": False, "reasoning_format": "auto", "return_progress": True,
}


async def test_llama_servers_web_ui_is_answered_as_llama_cpp_answers(
        mesh: Mesh, reference: Reference, http: aiohttp.ClientSession) -> None:
    """Its body was a 400 (`typical_p`, `mirostat`, ... and `max_tokens: -1`, then
    `reasoning_format: "auto"`, neutral for SmolLM2's template): now its off values are served,
    and the answer is the greedy one, to the end of generation."""
    prompt, out, text = reference.greedy(CAPITAL, 24)
    assert len(out) < 24  # the answer ends by itself, so no limit gives the same one
    model = (await mesh.openai().models.list()).data[0].id
    async with http.post(f"{mesh.url}/v1/chat/completions",
                         json={"model": model, "messages": CAPITAL, **WEB_UI_BODY}) as resp:
        assert resp.status == 200, await resp.text()
        chunks = [orjson.loads(e["data"]) async for e in read_sse(resp) if e["data"] != "[DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert [c["prompt_progress"]["processed"] for c in chunks if "prompt_progress" in c] == [len(prompt)]


LLAMA_ORDER = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]


async def _web_ui_answer(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        chunks = [orjson.loads(e["data"]) async for e in read_sse(resp) if e["data"] != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def test_llama_servers_web_ui_defaults_are_sampled_in_llama_cpps_order(
        mesh: Mesh, reference: Reference, http: aiohttp.ClientSession) -> None:
    """The web UI's default settings (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, and
    `samplers` in llama.cpp's default order: top_p before min_p and temperature) were a 400
    naming `samplers`. Now the tail samples in that order: the answer is the one llama.cpp's
    logits give through that chain with the request's seed, llama.cpp's own sampler chain keeps
    the same candidates at every step, and the same seed gives the same answer twice."""
    seed, max_tokens = 11, 16
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed,
                              order=("top_k", "top_p", "min_p", "temperature"))
    prompt = reference.prompt_ids(CAPITAL)
    kept_sets: list[tuple[set[int], set[int]]] = []

    def drawn(logits: np.ndarray, out: list[int]) -> np.ndarray:
        probs = tempered_probs(shaped_logits(logits, sampling), sampling)
        kept_sets.append(({int(i) for i in np.flatnonzero(probs)},
                          set(llama_cpp_kept(logits, sampling.order, sampling))))
        rng = token_rng(sampling, len(prompt) + len(out), np.random.default_rng())
        row = np.full_like(logits, -np.inf)
        row[choose_token(logits, sampling, rng).token_id] = 0.0
        return row

    _, _, expected = await asyncio.to_thread(reference.greedy_from, prompt, max_tokens, shape=drawn)
    assert all(ours == theirs for ours, theirs in kept_sets), kept_sets
    assert any(len(ours) > 1 for ours, _ in kept_sets)  # it really samples
    model = (await mesh.openai().models.list()).data[0].id
    body = {"model": model, "messages": CAPITAL, **WEB_UI_BODY, "samplers": LLAMA_ORDER, "temperature": 0.8,
            "seed": seed, "max_tokens": max_tokens}
    first = await _web_ui_answer(http, mesh.url, body)
    assert first == expected
    assert await _web_ui_answer(http, mesh.url, {**body, "samplers": "edskypmxt"}) == first
    body.pop("repeat_last_n")  # (llama-server's penalty window: refused with a penalty on)
    async with http.post(f"{mesh.url}/v1/chat/completions", json={
            **body, "samplers": ["top_k", "top_p", "penalties", "min_p", "temperature"], "presence_penalty": 1.0}) as resp:
        err = (await resp.json())["error"]  # the penalties come first here: a 400 naming samplers
        assert (resp.status, err["param"]) == (400, "samplers"), err


async def test_props_tells_llama_servers_web_ui_what_the_gateway_serves(
        mesh: Mesh, http: aiohttp.ClientSession, model_path: Path) -> None:
    """The web UI reads GET /props at start (context size, default settings, chat template,
    modalities): it was a 404. Now each value is the gateway's own, and a web UI request at
    those defaults is served."""
    async with http.get(f"{mesh.url}/props") as resp:
        assert resp.status == 200, await resp.text()
        props = await resp.json()
    model = (await mesh.openai().models.list()).data[0]
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == model.model_extra["context_length"] > 0  # the widest chain's
    assert props["model_alias"] == model.id and props["model_path"] == str(model_path)
    assert props["role"] == "model" and props["modalities"] == {"vision": False, "audio": False}
    assert "<|im_start|>" in props["chat_template"] and props["eos_token"] == "<|im_end|>"
    assert settings["params"]["temperature"] == 1.0 and settings["params"]["max_tokens"] == -1
    assert not {"total_slots", "speculative", "mirostat_tau"} & (set(props) | set(settings) | set(settings["params"]))
    sampled = {k: settings["params"][k] for k in ("temperature", "top_k", "top_p", "min_p", "samplers")}
    async with http.post(f"{mesh.url}/v1/chat/completions", json={
            "model": model.id, "messages": CAPITAL, **WEB_UI_BODY, **sampled, "max_tokens": 4}) as resp:
        assert resp.status == 200, await resp.text()
        assert [e async for e in read_sse(resp)][-1]["data"] == "[DONE]"


async def test_return_progress_sends_what_the_route_has_processed_of_a_long_prompt(
        mesh: Mesh, http: aiohttp.ClientSession) -> None:
    """The web UI streams with `return_progress: true` (it was a 400). A prompt of many prefill
    chunks: the head acknowledges each chunk when it queues it, so what the whole route has
    processed is known only when the tail's first token comes; one `prompt_progress` then says
    the prompt is done (processed == total == usage.prompt_tokens), before any content, with
    the prefill's time. No per-chunk guess is sent."""
    long = [{"role": "user", "content": "Summarise this list: " + ", ".join(f"item {i}" for i in range(60))}]
    model = (await mesh.openai().models.list()).data[0].id
    async with http.post(f"{mesh.url}/v1/chat/completions", json={
            "model": model, "messages": long, "stream": True, "return_progress": True, "max_tokens": 3,
            "temperature": 0, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status == 200, await resp.text()
        chunks = [orjson.loads(e["data"]) async for e in read_sse(resp) if e["data"] != "[DONE]"]
    total = chunks[-1]["usage"]["prompt_tokens"]
    assert total > 8 * 16  # the mesh's chunk_size: many prefill frames
    at = [i for i, c in enumerate(chunks) if "prompt_progress" in c]
    assert len(at) == 1, at
    progress = chunks[at[0]]["prompt_progress"]
    assert (progress["total"], progress["processed"], progress["cache"]) == (total, total, 0)
    assert progress["time_ms"] > 0
    assert chunks[at[0]]["choices"][0]["delta"] == {}
    assert not any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks[:at[0]])
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks[at[0] + 1:])


async def test_stop_string_cuts_the_answer(mesh: Mesh, reference: Reference) -> None:
    _, _, text = reference.greedy(COUNT, 40)
    stop = "4567"  # spans several tokens (one per digit here) and must not be emitted
    assert stop in text
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    for stream in (False, True):
        if stream:
            s = await client.chat.completions.create(
                model=model, messages=COUNT, max_tokens=40, temperature=0, stop=[stop, "zzz"],
                stream=True)
            chunks = [c async for c in s]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        else:
            r = await client.chat.completions.create(
                model=model, messages=COUNT, max_tokens=40, temperature=0, stop=stop)
            content, finish = r.choices[0].message.content, [r.choices[0].finish_reason]
        assert content == text[: text.index(stop)]
        assert finish == ["stop"]


# -- telemetry -------------------------------------------------------------------------------


async def test_telemetry_stream_opened_before_the_request(
    mesh: Mesh, http: aiohttp.ClientSession, reference: Reference
) -> None:
    sid = f"tele-{uuid.uuid4().hex[:8]}"
    events: list[tuple[float, GenerationTelemetry, int]] = []
    on_bus: list[GenerationTelemetry] = []

    async def follow() -> None:
        async with http.get(f"{mesh.url}/v1/sessions/{sid}/events") as resp:
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            async for ev in read_sse(resp):
                events.append((time.monotonic(), GenerationTelemetry.from_json(ev["data"].encode()),
                               int(ev["id"])))

    async def follow_bus() -> None:
        async with mesh.monitor.subscribe(subjects.session_telemetry(sid), GenerationTelemetry) as sub:
            async for msg in sub:
                on_bus.append(msg)
                if msg.phase in ("completed", "failed"):
                    return

    watcher = asyncio.create_task(follow())
    bus_watcher = asyncio.create_task(follow_bus())
    await asyncio.sleep(0.3)  # the stream is open and waiting for a session that does not exist yet
    assert not watcher.done() and events == []

    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    prompt, _, text = reference.greedy(COUNT, 48)
    stream = await client.chat.completions.create(
        model=model, messages=COUNT, max_tokens=48, temperature=0, stream=True,
        extra_headers={"x-route-session-id": sid})
    first_token_at = None
    content = ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first_token_at = first_token_at or time.monotonic()
            content += chunk.choices[0].delta.content
    assert content == text
    await watcher  # ends by itself after `completed`
    await bus_watcher

    tele = [e for _, e, _ in events]
    assert [i for _, _, i in events] == [e.seq for e in tele] == sorted({e.seq for e in tele})
    phases = [e.phase for e in tele]
    assert phases[0] == "queued" and phases[-1] == "completed"
    order = ["queued", "routing", "prefill", "decode", "finalizing", "completed"]
    assert [p for p in order if p in phases] == order
    assert sorted(phases, key=order.index) == phases
    prefill = [(t, e) for t, e, _ in events if e.phase == "prefill" and e.prefill_tokens_done > 0]
    done = [e.prefill_tokens_done for _, e in prefill]
    assert len(prefill) >= 2 and done == sorted(done) and done[-1] == len(prompt)
    assert all(e.prefill_tokens_total == len(prompt) for _, e in prefill)
    assert first_token_at is not None and prefill[0][0] < first_token_at
    decode = [e for e in tele if e.phase == "decode"]
    assert any(e.rolling_tokens_per_second > 0 for e in decode)
    assert [e.generated_tokens for e in decode] == sorted(e.generated_tokens for e in decode)
    last = tele[-1]
    assert last.generated_tokens == 48 and last.average_tokens_per_second > 0
    assert last.finish_reason == "length" and set(last.route_nodes) == {"gw-head", "gw-tail"}
    # the bus carries the same session, every phase change included
    assert [p for p in order if p in {e.phase for e in on_bus}] == order
    assert on_bus[-1].seq == last.seq

    # latest state as JSON, and Last-Event-ID replay of the bounded history
    status, state = await _get_json(http, f"{mesh.url}/v1/sessions/{sid}")
    assert status == 200 and state["phase"] == "completed" and state["seq"] == last.seq
    resume = tele[-3].seq
    async with http.get(f"{mesh.url}/v1/sessions/{sid}/events",
                        headers={"Last-Event-ID": str(resume)}) as resp:
        replay = [GenerationTelemetry.from_json(e["data"].encode()) async for e in read_sse(resp)]
    assert [e.seq for e in replay] == [e.seq for e in tele if e.seq > resume]
    status, body = await _get_json(http, f"{mesh.url}/v1/sessions/never-seen")
    assert status == 404 and body["error"]["code"] == "session_not_found"


async def test_all_sessions_stream(mesh: Mesh, http: aiohttp.ClientSession) -> None:
    got: list[GenerationTelemetry] = []
    sid = f"all-{uuid.uuid4().hex[:8]}"

    async def follow() -> None:
        async with http.get(f"{mesh.url}/v1/telemetry") as resp:
            async for ev in read_sse(resp):
                msg = GenerationTelemetry.from_json(ev["data"].encode())
                if msg.session_id == sid:
                    got.append(msg)
                    if msg.phase == "completed":
                        return

    watcher = asyncio.create_task(follow())
    await asyncio.sleep(0.2)
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    await client.chat.completions.create(
        model=model, messages=CAPITAL, max_tokens=4, temperature=0,
        extra_headers={"x-route-session-id": sid})
    await watcher
    assert got[0].phase == "queued" and got[-1].phase == "completed"


async def test_metrics_exposition(mesh: Mesh, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{mesh.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/plain")
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values["meshnet_gateway_time_to_first_token_seconds_count"] >= 4
    assert values["meshnet_gateway_time_per_output_token_seconds_count"] > 0
    assert values["meshnet_gateway_generated_tokens_total"] > 0
    assert values["meshnet_gateway_prompt_tokens_total"] > 0
    assert values["meshnet_gateway_active_sessions"] == 0


async def test_logit_bias_and_top_k_are_honoured_at_the_tail(mesh: Mesh, reference: Reference) -> None:
    """logit_bias changes a greedy answer exactly as the same bias on llama.cpp's own logits
    does; top_k 1 at temperature 1 is the greedy answer, whatever the draw."""
    _, out, text = reference.greedy(CAPITAL, 12)
    bias = {out[0]: -100.0}  # the greedy answer's first token, banned
    _, _, biased = reference.greedy(CAPITAL, 12, bias)
    assert biased != text
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    got = await client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=12, temperature=0,
                                               logit_bias={str(t): b for t, b in bias.items()})  # type: ignore[misc]
    assert got.choices[0].message.content == biased
    one = await client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=12, temperature=1.0,
                                               extra_body={"top_k": 1})
    assert one.choices[0].message.content == text


async def test_a_temperature_too_small_for_float32_answers_the_greedy_answer(mesh: Mesh, reference: Reference) -> None:
    """temperature 1e-40 is valid (0..2) but overflowed the tail's float32 row: NaN
    probabilities drew token 0, <|endoftext|>, and the answer was empty with finish_reason stop.
    It is now llama.cpp's greedy answer, as the limit of a vanishing temperature is."""
    _, _, text = reference.greedy(CAPITAL, 12)
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    got = await client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=12, temperature=1e-40,
                                               seed=5)
    assert got.choices[0].message.content == text and text


async def test_presence_and_frequency_penalties_are_honoured_at_the_tail(mesh: Mesh, reference: Reference) -> None:
    """OpenAI's penalties over the generated tokens change a greedy answer exactly as the same
    arithmetic on llama.cpp's own logits does."""
    presence, frequency = 2.0, 2.0

    def penalized(logits: np.ndarray, out: list[int]) -> np.ndarray:
        for t in set(out):
            logits[t] -= presence + frequency * out.count(t)
        return logits

    prompt = reference.prompt_ids(COUNT)  # off the loop: the tracker and gateway run on it
    _, plain, _ = await asyncio.to_thread(reference.greedy_from, prompt, 24)
    _, _, expected = await asyncio.to_thread(reference.greedy_from, prompt, 24, shape=penalized)
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    got = await client.chat.completions.create(model=model, messages=COUNT, max_tokens=24, temperature=0,
                                               presence_penalty=presence, frequency_penalty=frequency)
    assert got.choices[0].message.content == expected
    assert expected != reference.llm.detokenize(plain).decode()


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}},
          "required": ["name", "age", "colours"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Describe a person called Ada, aged 36, who likes red and blue, as JSON."}]


def _masked(model_path: Path, constraint: OutputConstraint) -> Callable[[np.ndarray, list[int]], np.ndarray]:
    """The row shaping of a constrained greedy answer, from llguidance directly."""
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from nodes.token_constraint import vocabulary_of

    tok = vocabulary_of(str(model_path))
    matcher = llguidance.LLMatcher(tok, grammar_of(constraint))
    bits = allocate_token_bitmask(1, tok.vocab_size)

    def shape(logits: np.ndarray, out: list[int]) -> np.ndarray:
        if out:
            assert matcher.consume_token(out[-1])
        fill_next_token_bitmask(matcher, bits, 0)
        allowed = np.unpackbits(bits[0].view(np.uint8), bitorder="little")[:len(logits)].astype(bool)
        return np.where(allowed, logits, -np.inf)

    return shape


async def test_response_format_json_schema_gives_an_answer_valid_against_it(
        mesh: Mesh, reference: Reference) -> None:
    """json_schema: the greedy answer through the mesh parses, has the schema's keys and types,
    and is the greedy answer of llama.cpp's own logits under the same grammar's mask; streamed
    too. json_object: a JSON object."""
    constraint = OutputConstraint(kind="json_schema", schema_text=orjson.dumps(PERSON).decode(), name="person")
    prompt = reference.prompt_ids(ASK_PERSON)
    _, _, expected = await asyncio.to_thread(reference.greedy_from, prompt, 60,
                                             shape=_masked(mesh.model_path, constraint))
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    got = await client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=60, temperature=0,
                                               response_format=fmt)  # type: ignore[arg-type]
    text = got.choices[0].message.content
    print("json_schema answer:", text)
    assert text == expected and got.choices[0].finish_reason == "stop"
    answer = orjson.loads(text)
    assert set(answer) == {"name", "age", "colours"} and isinstance(answer["name"], str)
    assert isinstance(answer["age"], int) and set(answer["colours"]) <= {"red", "green", "blue"}
    pieces = [c.choices[0].delta.content or "" async for c in await client.chat.completions.create(
        model=model, messages=ASK_PERSON, max_tokens=60, temperature=0, response_format=fmt, stream=True)]  # type: ignore[arg-type]
    assert "".join(pieces) == expected
    obj = await client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=40, temperature=0.8,
                                               seed=7, response_format={"type": "json_object"})
    print("json_object answer:", obj.choices[0].message.content)
    assert isinstance(orjson.loads(obj.choices[0].message.content), dict)


WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                      "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                                     "required": ["zone"], "additionalProperties": False}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


async def test_tool_calls_with_the_openai_sdk(mesh: Mesh) -> None:
    """The bundled model's template has no tool format: the JSON fallback. tool_choice
    "required" and a named function always give a valid call (the answer is constrained),
    whole and streamed; the call and its result render back for the next turn."""
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    got = await client.chat.completions.create(model=model, messages=ASK_WEATHER, tools=WEATHER_TOOLS,  # type: ignore[arg-type]
                                               tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=60)
    choice = got.choices[0]
    print("required:", choice.message.tool_calls, repr(choice.message.content))
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    args = orjson.loads(call.function.arguments)
    assert call.function.name in ("get_weather", "get_time") and isinstance(args, dict)
    assert isinstance(args["city" if call.function.name == "get_weather" else "zone"], str)
    named = await client.chat.completions.create(
        model=model, messages=ASK_WEATHER, tools=WEATHER_TOOLS, temperature=0.7, seed=3, max_tokens=60,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    assert [c.function.name for c in named.choices[0].message.tool_calls or []] == ["get_time"]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in await client.chat.completions.create(
            model=model, messages=ASK_WEATHER, tools=WEATHER_TOOLS, tool_choice="required",  # type: ignore[arg-type]
            parallel_tool_calls=False, temperature=0, max_tokens=60, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content  # a forced call's text is never sent as content
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            entry["name"] += piece.function.name or ""
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls[0]["name"] == call.function.name
    assert orjson.loads(calls[0]["arguments"]) == args
    follow = await client.chat.completions.create(model=model, temperature=0, max_tokens=30, tools=WEATHER_TOOLS,  # type: ignore[arg-type]
                                                  messages=[*ASK_WEATHER, choice.message.model_dump(exclude_none=True),
                                                            {"role": "tool", "tool_call_id": call.id,
                                                             "content": "18 degrees and sunny"}])
    print("after the result:", follow.choices[0].message)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


async def test_n_choices_each_a_route_session_of_its_own(mesh: Mesh, reference: Reference) -> None:
    """n = 3: greedy choices are the same answer three times; seeded sampled ones are each their
    own draw (seed + index), and choice 0 equals a request of n = 1 with the same seed; streamed
    chunks carry their choice's index; usage counts the prompt once."""
    _, out, text = await asyncio.to_thread(reference.greedy, CAPITAL, 12)  # off the loop the mesh runs on
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    greedy = await client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=12, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert [c.message.content for c in greedy.choices] == [text] * 3
    assert greedy.usage is not None and greedy.usage.completion_tokens == 3 * len(out)
    assert greedy.usage.prompt_tokens == len(reference.prompt_ids(CAPITAL))
    sampled = await client.chat.completions.create(model=model, messages=COUNT, max_tokens=16, temperature=1.0,
                                                   seed=11, n=3)
    alone = await client.chat.completions.create(model=model, messages=COUNT, max_tokens=16, temperature=1.0, seed=11)
    texts = [c.message.content for c in sampled.choices]
    assert texts[0] == alone.choices[0].message.content and len(set(texts)) > 1, texts
    pieces: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    ids = set()  # one answer, one id: every chunk of every choice carries it (as OpenAI and vLLM)
    async for chunk in await client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=12,
                                                            temperature=0, n=2, stream=True):
        ids.add(chunk.id)
        for c in chunk.choices:
            pieces[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert pieces == {0: text, 1: text} and set(finishes) == {0, 1} and len(ids) == 1
    legacy = await client.completions.create(model=model, prompt="The capital of France is", max_tokens=6,
                                             temperature=0, n=2)
    assert [c.index for c in legacy.choices] == [0, 1] and legacy.choices[0].text == legacy.choices[1].text
    prompts = ["The capital of France is", "One, two, three,"]
    batch = await client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0)
    alone = [(await client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0)) for p in prompts]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage is not None and batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)


TEXT_PROMPT = "The capital of France is"


async def test_legacy_completions_with_the_openai_sdk_equal_llama_cpp(mesh: Mesh, reference: Reference) -> None:
    """POST /v1/completions through the mesh: a text prompt (BOS as the vocabulary asks,
    special tokens parsed, as llama-server) and the same prompt as token ids give llama.cpp's
    greedy tokens; streaming, usage, echo and the legacy logprobs object."""
    from gateway.tokenizer import ModelTokenizer

    tok = ModelTokenizer(mesh.model_path)
    ids = tok.encode_text(TEXT_PROMPT)
    _, out, text = reference.greedy_from(ids, 10)
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    got = await client.completions.create(model=model, prompt=TEXT_PROMPT, max_tokens=10, temperature=0)
    assert got.object == "text_completion" and got.choices[0].text == text
    assert got.usage is not None and (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(out))
    by_ids = await client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == text
    chunks = [c async for c in await client.completions.create(
        model=model, prompt=TEXT_PROMPT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length" if len(out) == 10 else "stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(out)
    echoed = await client.completions.create(model=model, prompt=TEXT_PROMPT, max_tokens=10, temperature=0, echo=True)
    assert echoed.choices[0].text == TEXT_PROMPT + text
    scored = await client.completions.create(model=model, prompt=TEXT_PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = scored.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == len(lp.token_logprobs or []) == min(4, len(out))
    assert "".join(lp.tokens or []) == scored.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs or [])
    assert (lp.text_offset or [0])[0] == 0


async def test_legacy_completions_refuse_what_they_do_not_do(mesh: Mesh, http: aiohttp.ClientSession) -> None:
    model = (await mesh.openai().models.list()).data[0].id
    for extra, param in (({"prompt": ["a"] * 5, "n": 2}, "prompt"), ({"prompt": ["a", ""]}, "prompt[1]"), ({"prompt": "a", "suffix": "b"}, "suffix"),
                         ({"prompt": "a", "echo": True, "logprobs": 1}, "logprobs"), ({"prompt": [10**8]}, "prompt"),
                         ({"prompt": "a", "best_of": 3}, "best_of"), ({"prompt": "a", "tools": [{}]}, "tools"),
                         ({"prompt": "a", "top_logprobs": 2}, "top_logprobs"), ({"prompt": "a", "ignore_eos": True}, "ignore_eos"),
                         ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "messages"),
                         ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {}}},
                          "response_format")):
        async with http.post(f"{mesh.url}/v1/completions", json={"model": model, **extra}) as resp:
            err = (await resp.json())["error"]
            assert resp.status == 400 and err["param"] == param, (extra, err)
    # a completion's context error names its prompt, not a chat's messages
    for extra in ({"prompt": "word " * 4000}, {"prompt": "hi", "max_tokens": 5000}):
        async with http.post(f"{mesh.url}/v1/completions", json={"model": model, **extra}) as resp:
            err = (await resp.json())["error"]
            assert (resp.status, err["code"], err["param"]) == (400, "context_length_exceeded", "prompt"), err
            assert "messages" not in err["message"], err


# -- bad requests ----------------------------------------------------------------------------


async def test_bad_requests(mesh: Mesh, http: aiohttp.ClientSession) -> None:
    model = (await mesh.openai().models.list()).data[0].id
    ok = {"model": model, "messages": CAPITAL}
    long_text = "word " * 4000  # far beyond the nodes' 2048-token context
    cases: list[tuple[Any, dict[str, str], int, str | None, str | None]] = [
        (b"{not json", {}, 400, "invalid_json", None),
        ({"model": model}, {}, 400, "missing_required_parameter", "messages"),
        ({**ok, "temperature": 5}, {}, 400, "invalid_value", "temperature"),
        ({**ok, "max_tokens": -2}, {}, 400, "invalid_value", "max_tokens"),  # -1: no limit, as llama-server
        ({**ok, "n": 9}, {}, 400, "invalid_value", "n"),
        ({**ok, "model": "no-such-model"}, {}, 404, "model_not_found", "model"),
        ({**ok, "messages": [{"role": "user", "content": long_text}]}, {}, 400,
         "context_length_exceeded", "messages"),
        ({**ok, "max_tokens": 5000}, {}, 400, "context_length_exceeded", "messages"),
        (ok, {"x-route-session-id": "bad id!"}, 400, "invalid_session_id", "x-route-session-id"),
        # what the gateway does not honour yet is refused by name, never answered as if it were absent
        ({**ok, "functions": [{"name": "f", "parameters": {}}]}, {}, 400, "unsupported_parameter", "functions"),
        ({**ok, "guided_json": {"type": "object"}}, {}, 400, "unsupported_parameter", "guided_json"),
        ({**ok, "tools": [{"type": "function", "function": {"name": "no spaces", "parameters": {}}}]}, {}, 400,
         "invalid_value", "tools[0]"),
        ({**ok, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, {}, 400,
         "invalid_value", "response_format"),
        ({**ok, "validate": "yes"}, {}, 400, "invalid_value", "validate"),
    ]
    for body, headers, status, code, param in cases:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        async with http.post(f"{mesh.url}/v1/chat/completions", data=data,
                             headers={"content-type": "application/json", **headers}) as resp:
            got = await resp.json()
            assert resp.status == status, (body, got)
            err = got["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert (err["code"], err["param"]) == (code, param), got
            assert err["message"]
    # a session id ends where its characters end: no newline slips through at the end
    async with http.get(f"{mesh.url}/v1/sessions/abc%0A") as resp:
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_session_id"
    # the SDK turns them into typed errors
    client = mesh.openai()
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=CAPITAL)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=model, messages=CAPITAL, stream=True, n=9)
    assert info.value.code == "invalid_value"
    # a session id that is already in use
    sid = f"dup-{uuid.uuid4().hex[:8]}"
    await client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=2,
                                         extra_headers={"x-route-session-id": sid})
    with pytest.raises(openai.ConflictError):
        await client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=2,
                                             extra_headers={"x-route-session-id": sid})


# -- disconnects and failures ------------------------------------------------------------------


async def _wait_phase(http: aiohttp.ClientSession, url: str, sid: str) -> dict[str, Any]:
    while True:
        status, state = await _get_json(http, f"{url}/v1/sessions/{sid}")
        if status == 200 and state["phase"] in ("completed", "failed"):
            return state
        await asyncio.sleep(0.05)


async def test_client_disconnect_frees_every_hop(mesh: Mesh, http: aiohttp.ClientSession) -> None:
    model = (await mesh.openai().models.list()).data[0].id
    sid = f"gone-{uuid.uuid4().hex[:8]}"
    beats: dict[str, NodeHeartbeat] = {}

    async def follow_beats() -> None:
        async with mesh.monitor.subscribe(subjects.HEARTBEAT_ALL, NodeHeartbeat) as sub:
            async for hb in sub:
                beats[hb.node_id] = hb

    beat_task = asyncio.create_task(follow_beats())
    try:
        body = {"model": model, "messages": COUNT, "max_tokens": 400, "temperature": 0,
                "stream": True}
        async with aiohttp.ClientSession() as own:
            resp = await own.post(f"{mesh.url}/v1/chat/completions", json=body,
                                  headers={"x-route-session-id": sid})
            seen = 0
            async for ev in read_sse(resp):
                seen += '"content"' in ev["data"]
                if seen >= 5:
                    break
            resp.close()  # drop the connection mid-stream
        state = await _wait_phase(http, mesh.url, sid)
        assert state["phase"] == "failed"
        assert "disconnect" in state["failure_reason"]
        assert state["last_phase"] in ("decode", "prefill")
        assert state["generated_tokens"] < 400
        # both hops report no live session (their Hot KV State was released)
        marker = time.time()

        def released() -> bool:
            return len(beats) == 2 and all(
                b.ts > marker and b.sessions == 0 and b.cache_bytes == 0 for b in beats.values())

        while not released():  # noqa: ASYNC110 - heartbeats arrive on their own schedule
            await asyncio.sleep(0.1)
    finally:
        beat_task.cancel()


async def test_node_killed_mid_stream_then_recovered(
    mesh: Mesh, http: aiohttp.ClientSession, reference: Reference
) -> None:
    client = mesh.openai()
    model = (await client.models.list()).data[0].id
    sid = f"kill-{uuid.uuid4().hex[:8]}"
    stream = await client.chat.completions.create(
        model=model, messages=COUNT, max_tokens=400, temperature=0, stream=True,
        extra_headers={"x-route-session-id": sid})
    n_content = 0
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                n_content += 1
                if n_content == 3:
                    mesh.kill_node("gw-tail")
    assert n_content >= 3
    assert "decode" in info.value.message
    assert info.value.body["code"] and info.value.body["type"] == "route_failed"
    state = await _wait_phase(http, mesh.url, sid)
    assert state["phase"] == "failed" and state["last_phase"] == "decode"
    assert state["failure_reason"]
    # a non-streaming request while the tail is gone gets a 503 from routing (or 502 if the
    # tracker has not noticed yet) naming the phase
    with pytest.raises(openai.APIStatusError) as info2:
        await client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=4)
    assert info2.value.status_code in (502, 503)
    assert "routing" in info2.value.message or "prefill" in info2.value.message
    # restart the tail under a new id; the gateway serves again once a route exists
    mesh.start_node("gw-tail-2", "15:30")
    await wait_routable(mesh, {"gw-head", "gw-tail-2"}, http)
    _, _, text = reference.greedy(CAPITAL, 24)
    resp = await client.chat.completions.create(
        model=model, messages=CAPITAL, max_tokens=24, temperature=0)
    assert resp.choices[0].message.content == text


async def test_six_requests_through_a_two_session_gateway_queue_and_all_complete(
    mesh: Mesh, http: aiohttp.ClientSession
) -> None:
    """A second gateway on the same real mesh, capped at 2 sessions: the other 4 requests wait."""
    port = free_port()
    settings = GatewaySettings(port=port, nats_url=mesh.nats.url, model=str(mesh.model_path),
                               max_sessions=2, node_timeout=3.0, queue_tick=0.05, keepalive=1.0)
    runner = web.AppRunner(create_app(settings))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    ids = [f"queue-{i}-{uuid.uuid4().hex[:6]}" for i in range(6)]
    shown: dict[str, list[int]] = {sid: [] for sid in ids}
    done: set[str] = set()
    try:
        deadline = time.monotonic() + 120
        while (await _get_json(http, f"{url}/healthz"))[0] != 200:  # it learns the mesh from the bus
            assert time.monotonic() < deadline, "timed out waiting for the second gateway's /healthz"
            await asyncio.sleep(0.1)

        async def follow() -> None:
            async with http.get(f"{url}/v1/telemetry") as resp:
                async for ev in read_sse(resp):
                    msg = GenerationTelemetry.from_json(ev["data"].encode())
                    if msg.phase == "queued" and msg.queue_position is not None:
                        shown[msg.session_id].append(msg.queue_position)
                    if msg.phase == "completed":
                        done.add(msg.session_id)
                        if done == set(ids):
                            return

        watcher = asyncio.create_task(follow())
        await asyncio.sleep(0.2)

        async def ask(sid: str) -> int:
            body = {"model": "bundled", "messages": CAPITAL, "max_tokens": 16, "temperature": 0}
            async with http.post(f"{url}/v1/chat/completions", json=body,
                                 headers={"x-route-session-id": sid}) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.wait_for(asyncio.gather(*(ask(sid) for sid in ids)), 300)
        await asyncio.wait_for(watcher, 60)
    finally:
        await runner.cleanup()
    assert statuses == [200] * 6
    waited = [sid for sid in ids if shown[sid]]
    assert len(waited) >= 4, f"queue positions shown: {shown}"  # at most two ran at once
    assert all(p == sorted(p, reverse=True) for p in shown.values()), shown
