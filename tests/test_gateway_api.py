"""The gateway's HTTP edge with a real nats-server and the real tokenizer, over a scripted route.

Not about the route: a scripted route client stands in for RouteClient and a responder on
mesh.tracker.route.create stands in for the tracker. The real mesh is in test_gateway_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from multidict import CIMultiDict

from artifacts.bundled import model_id
from artifacts.revision import model_revision
from bus import subjects
from bus.client import Bus
from bus.server import NatsServer, free_port
from gateway.app import LOST_HOOK, create_app
from gateway.generation import Delta, Generation, GenerationPlan
from gateway.held_wait import LOST_NODE_WAIT_S
from gateway.metrics import GatewayMetrics
from gateway.routing import route_error_to_api
from gateway.settings import GatewaySettings
from gateway.state import BUS_STATE, MESH
from gateway.telemetry import SessionTelemetry
from gateway.tokenizer import ModelTokenizer
from schemas.capability import CapabilityReport, ShardRange
from schemas.frames import FrameResult, RouteFailedError
from schemas.node import NodeAnnouncement
from schemas.route import (
    Hop,
    RouteError,
    RouteFailure,
    RouteReply,
    RouteRequest,
    RouteSession,
)
from schemas.telemetry import GenerationTelemetry

MSG = [{"role": "user", "content": "hello"}]


@dataclass
class Script:
    """What the scripted route returns: tokens in order, and where (if anywhere) it fails."""

    tokens: list[int]
    fail_phase: str | None = None  # "prefill" or "decode"
    fail_after: int = 0  # decode steps before the failure
    fail_routes: int = 1_000  # how many routes fail that way (a restart's route may not)
    hang_after: int | None = None  # the first route stops answering after this many decode steps
    hang_prefill: bool = False  # the first route's prefill never answers (a long prompt still computing)
    # the first route's head goes quiet in prefill while its hops show progress to this many
    # probes (the rows behind the head crossing a slow link), then the prefill answers
    hops_busy: int = 0
    probes: int = 0  # hop_marks calls
    failures: int = 0
    prompt_len: int | None = None  # the first prefill's length: a restart re-prefills more
    prefills: list[int] = field(default_factory=list)  # tokens each route prefilled
    fed: list[list[int]] = field(default_factory=list)  # per route: the tokens fed as decode steps
    stepwise_from: list[int | None] = field(default_factory=list)  # per route: where its replay rows begin
    logprob: float = -0.25
    instant: bool = False  # decode steps answer without yielding to the loop (a burst of tokens)
    opened: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    used_rows: list[int | None] = field(default_factory=list)  # per released route: what its close told the hops
    verify: dict[int, tuple[int, int]] = field(default_factory=dict)  # token index -> a verify step's (drafted, kept)


class ScriptedRoute:
    """RouteClient's interface over a Script (prefill progress in chunks of 4)."""

    chunk_size = 4

    def __init__(self, session: RouteSession, script: Script) -> None:
        self.session = session
        self.script = script
        self.i = 0
        self.interrupted: RouteFailure | None = None
        self.used_rows: int | None = None
        self.woken = asyncio.Event()
        self.hops_done = asyncio.Event()

    async def hop_marks(self, timeout: float) -> tuple[tuple[int, ...] | None, ...]:
        """Two hops' progress marks: moving at each probe while the script's hops are busy."""
        self.script.probes += 1
        if self.script.probes >= self.script.hops_busy:
            self.hops_done.set()
        moved = min(self.script.probes, self.script.hops_busy)
        return ((moved, 0, 0), (0, 0, 0))

    async def __aenter__(self) -> ScriptedRoute:
        self.script.opened.append(self.session.session_id)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.script.released.append(self.session.session_id)
        self.script.used_rows.append(self.used_rows)

    def interrupt(self, failure: RouteFailure) -> None:
        """As RouteClient.interrupt: a frame waiting on the route fails with `failure`."""
        self.interrupted = failure
        self.woken.set()

    def _failing(self, phase: str) -> bool:
        return self.script.fail_phase == phase and self.script.failures < self.script.fail_routes

    def _fail(self, phase: str) -> RouteFailedError:
        self.script.failures += 1
        return RouteFailedError(RouteFailure(
            session_id=self.session.session_id, route_id=self.session.route_id, phase=phase,
            hop_index=1, node_id="tail", reason="hop unreachable: connection reset",
            code="hop_lost"))

    def _result(self) -> FrameResult:
        token = self.script.tokens[self.i]
        drafted, accepted = self.script.verify.get(self.i, (0, 0))
        self.i += 1
        return FrameResult(token_id=token, logprob=self.script.logprob,
                           top_logprobs=[(token, self.script.logprob), (0, -9.0)], position=self.i,
                           drafted=drafted, accepted=accepted)

    async def prefill(self, token_ids: Sequence[int], on_progress: Callable[[int, int], object] | None = None,
                      stepwise_from: int | None = None) -> FrameResult:
        for done in range(4, len(token_ids) + 4, 4):
            await asyncio.sleep(0)
            if on_progress is not None:
                on_progress(min(done, len(token_ids)), len(token_ids))
        if self.script.hops_busy and not self.script.prefills:
            waits = [asyncio.ensure_future(e.wait()) for e in (self.hops_done, self.woken)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if self.interrupted is not None:  # the watchdog left the route (stalled)
                raise RouteFailedError(self.interrupted)
        if self.script.hang_prefill and not self.script.prefills:
            await self.woken.wait()
            assert self.interrupted is not None
            raise RouteFailedError(self.interrupted)
        self.script.prefills.append(len(token_ids))
        self.script.stepwise_from.append(stepwise_from)
        self.script.fed.append([])
        if self.script.prompt_len is None:
            self.script.prompt_len = len(token_ids)
        self.i = len(token_ids) - self.script.prompt_len  # a restart continues after the tokens it re-prefilled
        if self._failing("prefill"):
            raise self._fail("prefill")
        return self._result()

    async def decode(self, token_id: int) -> FrameResult:
        if not self.script.instant:
            await asyncio.sleep(0.001)
        self.script.fed[-1].append(token_id)
        hang = self.script.hang_after
        if hang is not None and len(self.script.fed) == 1 and len(self.script.fed[0]) > hang:
            await self.woken.wait()  # a hop that neither answers nor fails
            assert self.interrupted is not None
            raise RouteFailedError(self.interrupted)
        if self._failing("decode") and self.i > self.script.fail_after:
            raise self._fail("decode")
        return self._result()

    results_ready = False

    async def decode_run(self, token_id: int, steps: int, stop_ids: Iterable[int] = (),
                         flush_ms: int = 0, draft: int = 0) -> AsyncGenerator[FrameResult, None]:
        """Like the head's Decode Run: tokens until `steps` or a stop id; with `flush_ms`, in
        threes that arrive together (results_ready while the rest of a three is there). A
        scripted route drafts nothing (its hops are not exact: `draft` is always 0 here)."""
        assert draft == 0
        stop = set(stop_ids)
        try:
            for i in range(steps):
                result = await self.decode(token_id)
                self.results_ready = bool(flush_ms) and i % 3 != 2 and i < steps - 1
                yield result
                if result.token_id in stop:
                    return
                token_id = result.token_id
        finally:
            self.results_ready = False


@dataclass
class Edge:
    url: str
    script: Script
    route_errors: list[RouteError | Exception | None]  # an Exception: that ask goes unanswered
    requests: list[RouteRequest]
    tokenizer: ModelTokenizer
    node_bus: Bus
    announce: Callable[[], Any]
    runner: web.AppRunner


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> ModelTokenizer:
    return ModelTokenizer(model_path)


def _capability(model_path: Path, start: int, end: int) -> CapabilityReport:
    return CapabilityReport(
        model_arch="llama", model_name="smol-test", model_revision=model_revision(model_path),
        runtime="llama.cpp", layers=ShardRange(start=start, end=end, n_layer=30),
        hidden_size=576, vocab_size=49152, n_ctx=256, cache_abi="test", cache_bytes_per_token=1,
    )


@pytest_asyncio.fixture
async def edge(nats_server: NatsServer, model_path: Path, tokenizer: ModelTokenizer,
               gateway_overrides: dict[str, Any]) -> AsyncIterator[Edge]:
    script = Script(tokens=[])
    route_errors: list[RouteError | Exception | None] = []
    requests: list[RouteRequest] = []
    tracker = await Bus.connect(nats_server.url, role="tracker", name="fake-tracker")
    node_bus = await Bus.connect(nats_server.url, role="node", name="fake-node")

    def route(req: RouteRequest) -> RouteReply:
        requests.append(req)
        error = route_errors.pop(0) if route_errors else None
        if isinstance(error, Exception):
            raise error  # the bus leaves the ask unanswered: a frozen tracker, as the gateway sees it
        if error is not None:  # None in the list: that request gets its route
            return RouteReply(error=error)
        hops = [Hop(node_id="head", activation_url="http://127.0.0.1:9", layer_start=0,
                    layer_end=15),
                Hop(node_id="tail", activation_url="http://127.0.0.1:9", layer_start=15,
                    layer_end=30)]
        return RouteReply(session=RouteSession(
            session_id=req.session_id or "x", route_id=f"r-{len(requests)}", epoch=req.epoch, model=req.model,
            model_revision=req.model, cache_abi="test", n_layer=30, hidden_size=576, n_ctx=256,
            hops=hops, sampling=req.sampling))

    await tracker.serve(subjects.ROUTE_CREATE, RouteRequest, route)

    async def announce() -> None:
        for node_id, (a, b) in {"head": (0, 15), "tail": (15, 30)}.items():
            await node_bus.publish(subjects.node_announce(node_id), NodeAnnouncement(
                node_id=node_id, activation_url="http://127.0.0.1:9",
                capability=_capability(model_path, a, b), started_at=0.0))
        await node_bus.flush()

    port = free_port()
    settings = GatewaySettings(**{
        "port": port, "nats_url": nats_server.url, "model": str(model_path), "session_wait": 0.3,
        "keepalive": 0.1, "decode_event_interval": 0.0, "max_telemetry_streams": 2, "stall_timeout": 1.0,
        **gateway_overrides})
    app = create_app(settings, open_route=lambda session: ScriptedRoute(session, script))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield Edge(f"http://127.0.0.1:{port}", script, route_errors, requests, tokenizer,
                   node_bus, announce, runner)
    finally:
        await runner.cleanup()
        await node_bus.close()
        await tracker.close()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def _sse_data(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]

def _streamed_text(data: list[str]) -> str:
    """The content of a chat stream's chunks (`data`: _sse_data's, ending with [DONE])."""
    return "".join(orjson.loads(d)["choices"][0]["delta"].get("content") or "" for d in data[:-1]
                   if orjson.loads(d)["choices"])


def _byte_tokens(tok: ModelTokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte of `text` (byte-level BPE has a token for every byte)."""
    by_byte: dict[bytes, int] = {}
    for t in range(tok.n_vocab):
        b = tok.token_bytes(t)
        if len(b) == 1 and b not in by_byte:
            by_byte[b] = t
    return [by_byte[bytes([c])] for c in text.encode()]


async def test_health_and_models_follow_announcements(edge: Edge, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{edge.url}/healthz") as resp:
        assert resp.status == 503
        assert "no live node" in (await resp.json())["reason"]
    async with http.get(f"{edge.url}/v1/models") as resp:
        assert (await resp.json())["data"] == []
    await edge.announce()
    while True:  # the announcements reach the gateway's mesh view asynchronously
        async with http.get(f"{edge.url}/healthz") as resp:
            if resp.status == 200:
                break
        await asyncio.sleep(0.02)
    async with http.get(f"{edge.url}/v1/models") as resp:
        data = (await resp.json())["data"]
    assert [m["id"] for m in data] == ["smol-test"] and data[0]["context_length"] == 256
    # the request may use the announced name; the tracker is asked for the revision
    edge.script.tokens = [*edge.tokenizer.tokenize("Hi"), min(edge.tokenizer.eog_ids)]
    status, _, _ = await _post(http, edge.url, {"model": "smol-test", "messages": MSG})
    assert status == 200 and edge.requests[-1].model == model_revision(edge.tokenizer.path)
    # GET /v1/models/{name} knows every name a chat request may use (models.retrieve, then chat)
    for name in ("smol-test", "bundled", model_revision(edge.tokenizer.path)):
        async with http.get(f"{edge.url}/v1/models/{name}") as resp:
            assert resp.status == 200 and (await resp.json())["id"] == "smol-test", name
    async with http.get(f"{edge.url}/v1/models/no-such-model") as resp:
        assert resp.status == 404
    # announced n_ctx is the context limit before routing
    long = [{"role": "user", "content": "hello " * 300}]
    status, _, raw = await _post(http, edge.url, {"model": "smol-test", "messages": long})
    assert status == 400 and orjson.loads(raw)["error"]["code"] == "context_length_exceeded"


async def test_health_under_llama_servers_and_vllms_names(edge: Edge, http: aiohttp.ClientSession) -> None:
    """GET /health (both servers) and /v1/health (llama-server) were a plain-text 404: clients and
    probes written for them now get /healthz's answer."""
    for path in ("/health", "/v1/health"):
        async with http.get(f"{edge.url}{path}") as resp:
            assert resp.status == 503 and (await resp.json())["status"] == "unavailable", path
    await edge.announce()
    while True:
        async with http.get(f"{edge.url}/health") as resp:
            if resp.status == 200:
                assert (await resp.json())["status"] == "ok"
                break
        await asyncio.sleep(0.02)


async def _tokens(http: aiohttp.ClientSession, url: str, path: str, body: Any) -> tuple[int, Any]:
    async with http.post(f"{url}{path}", json=body) as resp:
        return resp.status, await resp.json()


async def test_tokenize_and_detokenize_as_llama_server_and_vllm(edge: Edge, http: aiohttp.ClientSession) -> None:
    """Both servers' POST /tokenize and /detokenize (they were 404s), with the ids the gateway
    routes: a chat request's prompt ids are what `messages` tokenizes to."""
    tok = edge.tokenizer
    text = "Hello <|im_end|> w\u00f6rld"
    status, body = await _tokens(http, edge.url, "/tokenize", {"content": text})
    assert status == 200 and body == {"tokens": tok.tokenize(text)} and 2 in body["tokens"]  # <|im_end|> parsed
    _, body = await _tokens(http, edge.url, "/tokenize", {"content": text, "parse_special": False})
    assert 2 not in body["tokens"] and body["tokens"] == tok.tokenize(text, special=False)
    _, body = await _tokens(http, edge.url, "/tokenize", {"content": "\u00e9", "with_pieces": True})
    pieces = body["tokens"]
    assert b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces) \
        == "\u00e9".encode() and [p["id"] for p in pieces] == tok.tokenize("\u00e9")
    _, body = await _tokens(http, edge.url, "/tokenize", {"content": "<|im_end|>", "with_pieces": True})
    assert body["tokens"] == [{"id": 2, "piece": "<|im_end|>"}]
    status, body = await _tokens(http, edge.url, "/tokenize", {"model": "bundled", "prompt": "Hello world",
                                                                "return_token_strs": True})
    assert status == 200 and body["tokens"] == tok.encode_text("Hello world") and body["count"] == len(body["tokens"])
    assert body["token_strs"] == ["Hello", "\u0120world"] and body["max_model_len"] == tok.n_ctx_train
    _, body = await _tokens(http, edge.url, "/tokenize", {"model": "bundled", "messages": MSG})
    edge.script.tokens = [*tok.tokenize("Hi"), min(tok.eog_ids)]
    await edge.announce()
    while True:
        status, answer = await _tokens(http, edge.url, "/v1/chat/completions", {"model": "bundled", "messages": MSG})
        if status == 200:
            break
        await asyncio.sleep(0.02)
    assert body["count"] == answer["usage"]["prompt_tokens"] and body["tokens"] == tok.encode_chat(MSG)
    status, body = await _tokens(http, edge.url, "/detokenize", {"tokens": tok.tokenize(text)})
    assert status == 200 and body == {"content": text, "prompt": text}
    for path, request, param, code in (
            ("/tokenize", {"content": "a", "bogus": 1}, "bogus", "unsupported_parameter"),
            ("/tokenize", {"content": 5}, "content", "invalid_value"),
            ("/tokenize", {"text": "a"}, "content", "missing_required_parameter"),
            ("/tokenize", {"messages": MSG, "add_generation_prompt": False}, "add_generation_prompt", "invalid_value"),
            ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, "messages[0].role", "invalid_value"),
            ("/tokenize", {"model": "no-such-model", "prompt": "a"}, "model", "model_not_found"),
            ("/detokenize", {"tokens": [tok.n_vocab]}, "tokens", "invalid_value"),
            ("/detokenize", {"tokens": ["a"]}, "tokens[0]", "invalid_value")):
        status, body = await _tokens(http, edge.url, path, request)
        assert status in (400, 404) and (body["error"]["param"], body["error"]["code"]) == (param, code), request


async def test_stream_never_splits_utf8_and_sends_openai_chunks(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    text = "é😀 ok"
    edge.script.tokens = [*_byte_tokens(edge.tokenizer, text), min(edge.tokenizer.eog_ids)]
    status, headers, raw = await _post(http, edge.url, {
        "model": "bundled", "messages": MSG, "stream": True, "temperature": 0.7, "seed": 5})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    data = _sse_data(raw)
    assert data[-1] == "[DONE]"
    chunks = [orjson.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]]
    assert all(d and "\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "stop"}
    assert all("usage" not in c for c in chunks)
    assert {c["id"] for c in chunks} == {f"chatcmpl-{headers['x-route-session-id']}"}
    req = edge.requests[-1]
    assert (req.sampling.temperature, req.sampling.seed) == (0.7, 5)
    assert req.prompt_tokens == len(edge.tokenizer.encode_chat(MSG))
    assert edge.script.released == edge.script.opened  # the route was released


async def test_stop_string_across_tokens_with_logprobs(edge: Edge, http: aiohttp.ClientSession) -> None:
    edge.script.tokens = [*_byte_tokens(edge.tokenizer, "abc<|x|>def"), 0]
    status, _, raw = await _post(http, edge.url, {
        "model": "bundled", "messages": MSG, "stop": ["<|x|>"], "logprobs": True,
        "top_logprobs": 2, "max_tokens": 50})
    body = orjson.loads(raw)
    assert status == 200
    choice = body["choices"][0]
    assert choice["message"]["content"] == "abc" and choice["finish_reason"] == "stop"
    # the route's close tells the hops the rows the answer used (the prompt, each kept token but
    # the last), not the steps the head ran past the stop string (the Work Ledger pays those)
    usage = body["usage"]
    assert edge.script.used_rows == [usage["prompt_tokens"] + usage["completion_tokens"]]
    lp = choice["logprobs"]["content"]
    assert [e["token"] for e in lp][:3] == ["a", "b", "c"]
    assert lp[0]["logprob"] == -0.25 and lp[0]["bytes"] == [97]
    assert len(lp[0]["top_logprobs"]) == 2
    # the stop string's tokens were generated (usage counts them) but their text never shows:
    # their logprobs do not either (as llama-server trims them)
    assert body["usage"]["completion_tokens"] == len("abc<|x|>") and len(lp) == len("abc")


@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_cover_the_shown_text_when_a_stop_strings_start_repeats(
        edge: Edge, http: aiohttp.ClientSession, stream: bool) -> None:
    """"xEEND" with stop "END": the first "E" is shown once the second shows it cannot start the
    stop string, and only its logprob goes with it; the stop string's own tokens send none."""
    edge.script.tokens = [*_byte_tokens(edge.tokenizer, "xEENDyz"), 0]
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "stop": ["END"],
                                                  "logprobs": True, "max_tokens": 20, "stream": stream})
    assert status == 200
    if stream:
        chunks = [orjson.loads(d)["choices"][0] for d in _sse_data(raw)[:-1]]
        text = "".join(c["delta"].get("content") or "" for c in chunks)
        tokens = [e["token"] for c in chunks for e in (c.get("logprobs") or {}).get("content") or []]
    else:
        choice = orjson.loads(raw)["choices"][0]
        text, tokens = choice["message"]["content"], [e["token"] for e in choice["logprobs"]["content"]]
    assert text == "xE" and "".join(tokens) == text


async def test_a_run_that_ends_right_after_a_stop_string_closes_with_the_rows_the_answer_used(
        edge: Edge) -> None:
    """A slow client holds the session at the token before the stop string while the run's
    last tokens arrive and the run ends by itself. The route's close still waits for the
    session's decision and tells the hops the rows the answer used (before, the run's driver
    closed the route at once, telling them nothing, and each claimed every row it ran)."""
    edge.script.tokens = [*_byte_tokens(edge.tokenizer, "abc<|x|>def"), 0]
    edge.script.instant = True  # the run's tokens come in one burst, and the run ends
    prompt = edge.tokenizer.encode_chat(MSG)
    session = RouteSession(session_id="s", route_id="r", model="x", model_revision="x", cache_abi="x",
                           n_layer=30, hidden_size=576, n_ctx=256,
                           hops=[Hop(node_id="n", activation_url="http://127.0.0.1:9", layer_start=0, layer_end=30)])
    generation = Generation(
        GenerationPlan(session, prompt, max_tokens=len("abc<|x|>") + 2, stop=("<|x|>",)),
        tokens=edge.tokenizer, open_route=lambda s: ScriptedRoute(s, edge.script),
        telemetry=SessionTelemetry("s", "x", lambda *_: None), metrics=GatewayMetrics(), started=0.0)
    text = []
    async for ev in generation.run():
        if isinstance(ev, Delta):
            text.append(ev.text)
            await asyncio.sleep(0.05)  # a slow client: the run ends meanwhile
    assert "".join(text) == "abc" and len(edge.script.fed[0]) == len("abc<|x|>") + 1
    assert edge.script.used_rows == [len(prompt) + len(generation.output_ids)]


async def test_usage_counts_the_kept_drafts_the_answer_has(edge: Edge, http: aiohttp.ClientSession) -> None:
    """A verify step kept 4 drafts ("bcde", then "f" is its one more), and the answer stops at
    the stop string "bc" inside them: usage counts the 2 kept drafts the answer has, never more
    than its tokens (before: all 4, above completion_tokens 3)."""
    edge.script.tokens = [*_byte_tokens(edge.tokenizer, "abcdefgh"), 0]
    edge.script.verify = {1: (5, 4)}
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "stop": ["bc"],
                                                  "max_tokens": 20})
    usage = orjson.loads(raw)["usage"]
    assert status == 200 and usage["completion_tokens"] == 3
    assert usage["speculation"] == {"drafted_tokens": 5, "accepted_tokens": 2}


async def test_length_limit_and_usage_chunk(edge: Edge, http: aiohttp.ClientSession) -> None:
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    status, _, raw = await _post(http, edge.url, {
        "model": "bundled", "messages": MSG, "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    chunks = [orjson.loads(d) for d in _sse_data(raw)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "abcde"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


async def test_route_failure_non_streaming_is_502_naming_the_phase(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    edge.script.tokens = [100, 101]
    edge.script.fail_phase = "prefill"
    status, headers, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG},
                                       headers={"x-route-session-id": "fails-in-prefill",
                                                "x-meshnet-restart": "off"})
    err = orjson.loads(raw)["error"]
    assert status == 502 and headers["x-route-session-id"] == "fails-in-prefill"
    assert err["type"] == "route_failed" and err["code"] == "hop_lost"
    assert "during prefill" in err["message"] and "tail" in err["message"]
    async with http.get(f"{edge.url}/v1/sessions/fails-in-prefill") as resp:
        state = await resp.json()
    assert state["phase"] == "failed" and state["last_phase"] == "prefill"
    assert "connection reset" in state["failure_reason"]


async def test_route_failure_mid_stream_is_an_error_chunk(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    edge.script.fail_phase, edge.script.fail_after = "decode", 3
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG,
                                                  "stream": True, "restart": False})
    data = _sse_data(raw)
    assert status == 200 and "[DONE]" not in data
    assert "".join(orjson.loads(d)["choices"][0]["delta"].get("content") or ""
                   for d in data[:-1]) == "abcd"  # prefill's token + 3 decode steps
    err = orjson.loads(data[-1])["error"]
    assert err["type"] == "route_failed" and "during decode" in err["message"]
    async with http.get(f"{edge.url}/metrics") as resp:
        text = await resp.text()
    assert 'meshnet_gateway_session_failures_total{phase="decode"} 1' in text
    assert 'meshnet_gateway_requests_total{outcome="route_failed"} 1' in text


async def test_route_failure_mid_stream_of_several_choices_ends_as_one_choices_does(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    """n > 1: a choice's route failure ends the stream with the route_failed error chunk and no
    `[DONE]`, counted `route_failed`, as with one choice (before: `[DONE]` after the error, and
    counted as a 502 the client never got)."""
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    edge.script.fail_phase, edge.script.fail_after = "decode", 3
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "n": 2,
                                                  "stream": True, "restart": False})
    data = _sse_data(raw)
    assert status == 200 and "[DONE]" not in data, data[-2:]
    assert orjson.loads(data[-1])["error"]["type"] == "route_failed"
    async with http.get(f"{edge.url}/metrics") as resp:
        text = await resp.text()
    assert 'meshnet_gateway_requests_total{outcome="route_failed"} 1' in text


@pytest.mark.parametrize("gateway_overrides", [{"max_sessions": 1, "max_queue": 1}])
async def test_a_requests_own_choices_never_fill_the_queue_against_it(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    """n = 3 on an idle gateway of one place and a queue of one: the request is served (before:
    choices 1 and 2 both queued behind choice 0, the second got 503 queue_full, and a client's
    retries after Retry-After met the same refusal every time)."""
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abc")
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "n": 3, "max_tokens": 3})
    assert status == 200, raw
    assert [c["message"]["content"] for c in orjson.loads(raw)["choices"]] == ["abc"] * 3


async def _phases(http: aiohttp.ClientSession, url: str, sid: str) -> list[dict[str, Any]]:
    """Every telemetry event of a finished session (replayed from its history)."""
    async with http.get(f"{url}/v1/sessions/{sid}/events") as resp:
        raw = await resp.read()
    return [orjson.loads(d) for d in _sse_data(raw)]


async def test_a_lost_hop_in_decode_continues_on_a_new_route_without_the_lost_node(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    edge.script.fail_phase, edge.script.fail_after, edge.script.fail_routes = "decode", 3, 1
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "stream": True,
                                                  "max_tokens": 8},
                                       headers={"x-route-session-id": "moves-once"})
    data = _sse_data(raw)
    assert status == 200 and data[-1] == "[DONE]", data
    text = _streamed_text(data)
    assert text == "abcdefgh"  # no token repeated, none missing
    first, second = edge.requests[-2:]
    assert second.epoch == 2 and second.session_id == "moves-once-e2"
    assert second.policy.exclude_nodes == ["tail"] and first.policy.exclude_nodes == []
    prompt = edge.script.prefills[0]
    assert edge.script.prefills == [prompt, prompt + 4]  # the new route prefilled the prompt + the 4 tokens given,
    assert edge.script.stepwise_from[1] == prompt  # those 4 in stepwise frames (a model call per row)
    assert edge.script.fed[1][0] == edge.script.tokens[4]  # and decoding went on from the 5th
    assert edge.script.released == ["moves-once", "moves-once-e2"]
    events = await _phases(http, edge.url, "moves-once")
    restarting = [e for e in events if e["phase"] == "restarting"]
    assert restarting and restarting[0]["restarts"] == 1 and restarting[0]["lost_node_id"] == "tail"
    assert "connection reset" in restarting[0]["restart_reason"]
    assert events[-1]["phase"] == "completed" and events[-1]["restarts"] == 1
    async with http.get(f"{edge.url}/metrics") as resp:
        metrics = await resp.text()
    assert 'meshnet_gateway_restarts_total{outcome="resumed"} 1' in metrics
    assert "meshnet_gateway_restart_seconds_count 1" in metrics


@pytest.mark.parametrize("gateway_overrides", [{"route_timeout": 0.3}])
async def test_a_restart_asks_again_while_no_tracker_answers(edge: Edge, http: aiohttp.ClientSession) -> None:
    """A hop lost while no tracker answers (nats-server frozen, the only tracker restarting):
    the restart asks again within its wait, as for a full mesh (before: the stream failed after
    one route timeout with 'restart 1 of 2 found no new route: ... did not answer')."""
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    edge.script.fail_phase, edge.script.fail_after, edge.script.fail_routes = "decode", 3, 1
    edge.route_errors.extend([None, RuntimeError("frozen"), RuntimeError("frozen")])
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "stream": True,
                                                  "max_tokens": 8})
    data = _sse_data(raw)
    assert status == 200 and data[-1] == "[DONE]", data[-2:]
    assert _streamed_text(data) == "abcdefgh"
    assert [r.epoch for r in edge.requests] == [1, 2, 2, 2]


async def test_a_lost_hop_in_prefill_restarts_the_prompt(edge: Edge, http: aiohttp.ClientSession) -> None:
    edge.script.tokens = [100, 101]
    edge.script.fail_phase, edge.script.fail_routes = "prefill", 1
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "max_tokens": 2})
    assert status == 200, raw
    body = orjson.loads(raw)
    assert body["usage"]["completion_tokens"] == 2
    assert edge.script.prefills[0] == edge.script.prefills[1]  # nothing was generated before the loss


async def test_restarts_are_bounded_and_the_failure_names_them(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    edge.script.fail_phase, edge.script.fail_after = "decode", 2  # every route fails
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG})
    err = orjson.loads(raw)["error"]
    assert status == 502 and err["code"] == "hop_lost" and "during decode" in err["message"]
    assert len(edge.requests) == 3  # the first route and --max-restarts (2) more
    assert "after 2 restart(s), at most 2" in err["message"]
    assert [r.epoch for r in edge.requests] == [1, 2, 3]


async def test_a_restart_without_a_new_route_fails_with_the_lost_hop(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    edge.script.fail_phase, edge.script.fail_after = "decode", 2
    gap = RouteError(code="no_coverage", message="gap", missing_ranges=[(15, 30)])
    edge.route_errors.extend([None, *[gap] * 1000])  # the lost node never comes back (a dead one)
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG},
                                 headers={"x-route-session-id": "nowhere-to-go"})
    edge.route_errors.clear()
    err = orjson.loads(raw)["error"]
    assert status == 502 and err["code"] == "hop_lost"
    # without it, then any route (the lost node once heard from again), asked again until LOST_NODE_WAIT_S
    excluding = [bool(r.policy.exclude_nodes) for r in edge.requests]
    assert excluding[:2] == [False, True] and len(excluding) > 3 and not any(excluding[2:]), excluding
    assert "restart 1 of 2 found no new route" in err["message"] and "missing layers" in err["message"]
    async with http.get(f"{edge.url}/metrics") as resp:
        assert 'meshnet_gateway_restarts_total{outcome="failed"} 1' in await resp.text()


async def test_a_lost_hop_whose_node_is_routable_again_serves_the_restart(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    """A hop lost to a reset connection while its node lives (one link of a WAN reset): no route
    avoids it, and the tracker refuses routes through it until it hears from it again. The
    restart waits for that and goes on (before: the answer failed at the first refusal)."""
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    edge.script.fail_phase, edge.script.fail_after, edge.script.fail_routes = "decode", 3, 1
    gap = RouteError(code="no_coverage", message="gap", missing_ranges=[(15, 30)])
    edge.route_errors.extend([None, gap, gap, gap])  # the fourth ask, without exclusions, is routed
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "stream": True,
                                                  "max_tokens": 8})
    data = _sse_data(raw)
    assert status == 200 and data[-1] == "[DONE]", data[-2:]
    assert _streamed_text(data) == "abcdefgh"
    assert [bool(r.policy.exclude_nodes) for r in edge.requests] == [False, True, False, False, False]


async def test_a_route_that_stops_answering_is_left_at_the_stall_deadline(
    edge: Edge, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    edge.script.hang_after = 3  # the 4th decode step never comes back (a partitioned hop)
    with caplog.at_level(logging.WARNING, logger="meshnet.gateway.generation"):
        status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "max_tokens": 8},
                                     headers={"x-route-session-id": "stalls"})
    # no hop named: the log does not claim one was lost (it read 'lost a hop')
    assert "session stalls had its route fail in decode" in caplog.text and "lost a hop" not in caplog.text
    assert status == 200, raw
    assert orjson.loads(raw)["choices"][0]["message"]["content"] == "abcdefgh"
    events = await _phases(http, edge.url, "stalls")
    restarting = [e for e in events if e["phase"] == "restarting"]
    assert restarting and "no progress for 1.0 s" in restarting[0]["restart_reason"]
    assert restarting[0]["lost_node_id"] is None  # no hop to blame: the same nodes may serve again


async def test_a_client_that_leaves_during_prefill_releases_the_route_at_once(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    """No token comes during a long prefill to notice the client leaving by: the session looks
    for its client on its own, and ends the route long before the prefill's stall deadline."""
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    edge.script.hang_prefill = True
    body = {"model": "bundled", "messages": MSG, "max_tokens": 8}
    with contextlib.suppress(asyncio.TimeoutError):
        async with http.post(f"{edge.url}/v1/chat/completions", json=body, headers={"x-route-session-id": "leaves"},
                             timeout=aiohttp.ClientTimeout(total=0.5)) as resp:
            await resp.read()
    for _ in range(100):  # 3 s: the prefill's stall deadline here is 6 s, the client check 0.5 s
        if edge.script.released:
            break
        await asyncio.sleep(0.03)
    assert edge.script.opened == edge.script.released == ["leaves"]
    assert edge.script.prefills == []  # released, not restarted


def test_the_stall_deadline_follows_the_routes_step_time() -> None:
    from gateway.generation import hops_moved, stall_deadline
    from gateway.route_client import hop_mark

    assert stall_deadline("decode", None, 10.0) == 10.0
    assert stall_deadline("decode", 0.02, 10.0) == 10.0
    assert stall_deadline("decode", 2.0, 10.0) == 40.0  # a slow route: 20 of its steps
    assert stall_deadline("prefill", 0.02, 10.0) == 30.0
    # prefill frames of 512 rows: a hop shows no progress while it computes one
    assert stall_deadline("prefill", None, 10.0, rows=512) == 55.6
    # progress behind the head: any hop's mark that changed between two probes it answered
    assert hops_moved([(1, 0, 0), (0, 0, 0)], [(1, 0, 0), (16, 0, 0)])
    assert not hops_moved([(1, 0, 0), None], [(1, 0, 0), (16, 0, 0)])
    assert not hops_moved([(1, 0, 0), (16, 0, 0)], [(1, 0, 0), None])
    assert hop_mark(200, b'{"position": 32, "done": 1, "prefill_tokens": 16, "frames": 2}') == (32, 1, 16)
    assert hop_mark(401, b'{"position": 32, "done": 1, "prefill_tokens": 16}') is None
    assert hop_mark(200, b'{"position": true, "done": 1, "prefill_tokens": 16}') is None
    assert hop_mark(200, b'{"position": 32}') is None
    assert hop_mark(200, b"<html>") is None


async def test_a_prefill_whose_hops_still_work_behind_a_quiet_head_is_not_a_stall(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    """The head has acknowledged every chunk, and the hops behind it take the prompt's rows far
    longer than the prefill's stall deadline (3.2 s here): each probe of the hops shows them
    further on, so the route is not stalled (before, only the head's acknowledgements counted,
    and a long prompt over a slow link restarted at the deadline, again and again)."""
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    edge.script.hops_busy = 6  # probes come every stall_timeout (1 s): ~6 s without a word from the head
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "max_tokens": 8},
                                 headers={"x-route-session-id": "behind"})
    assert status == 200, raw
    assert orjson.loads(raw)["choices"][0]["message"]["content"] == "abcdefgh"
    assert edge.script.prefills == [edge.script.prompt_len]  # one route: no restart
    assert edge.script.probes >= 6


async def test_a_bad_restart_header_is_a_400(edge: Edge, http: aiohttp.ClientSession) -> None:
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG},
                                 headers={"x-meshnet-restart": "sometimes"})
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "x-meshnet-restart"
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "restart": "no"})
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "restart"
    # the body's field wins, but a header it overrides is still read: a bad one is named, not ignored
    for name, header in (("restart", "x-meshnet-restart"), ("speculative", "x-meshnet-speculative")):
        status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, name: False},
                                     headers={header: "yes"})
        assert status == 400 and orjson.loads(raw)["error"]["param"] == header, raw


@pytest.mark.parametrize("parameters", [
    {"type": "nope"}, {"$ref": "#/$defs/Missing"},
    {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(400)}},
])
async def test_a_forced_call_of_a_tool_whose_schema_cannot_compile_is_a_400(
        edge: Edge, http: aiohttp.ClientSession, parameters: dict[str, Any]) -> None:
    """Refused before any route, naming `tools`, as a bad `response_format` is: a node would
    refuse the session, and no other node does better (before: a 502 that took the node for
    lost, and a restart on another route)."""
    status, _, raw = await _post(http, edge.url, {
        "model": "bundled", "messages": MSG, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]})
    error = orjson.loads(raw)["error"]
    assert status == 400 and error["param"] == "tools" and error["code"] == "invalid_value", error
    assert edge.requests == [] and edge.script.opened == []  # no route was asked for


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (RouteError(code="no_coverage", message="gap", missing_ranges=[(15, 30)]), 503,
         "no_coverage"),
        # the gateway asks only for the model it serves: the tracker knowing no node of it means
        # none has joined yet (or all left), a 503 to retry, never a 404 naming the revision
        (RouteError(code="unknown_model", message="?"), 503, "no_nodes"),
    ],
)
async def test_tracker_errors_come_before_any_stream(
    edge: Edge, http: aiohttp.ClientSession, error: RouteError, status: int, code: str
) -> None:
    edge.route_errors.append(error)
    got, headers, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG,
                                                     "stream": True})
    assert got == status and headers["Content-Type"].startswith("application/json")
    assert orjson.loads(raw)["error"]["code"] == code
    if code == "no_nodes":
        assert headers["Retry-After"] == "2" and "retry shortly" in orjson.loads(raw)["error"]["message"]
    sid = headers["x-route-session-id"]
    async with http.get(f"{edge.url}/v1/sessions/{sid}") as resp:
        state = await resp.json()
    assert state["phase"] == "failed" and state["last_phase"] == "routing"
    assert edge.script.opened == []  # no route client was ever opened


async def test_a_request_whose_only_gap_is_a_held_node_queues_until_it_is_back(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    """A new request while the tracker holds a just-lost node out of routes (a reset link; the
    node is alive): it waits in the queue (phase `queued`, no byte of its stream sent) and is
    served once the tracker routes through the node again. Before: an immediate 503
    `no_coverage` for the 1-2 s the tracker took to hear from the node again."""
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcd")
    held = RouteError(code="no_coverage", message="gap", missing_ranges=[(15, 30)], held_nodes=["n1"], held_s=0.0)
    edge.route_errors.extend([held, held, held])
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "stream": True,
                                                  "max_tokens": 4}, headers={"x-route-session-id": "held-then-back"})
    data = _sse_data(raw)
    assert status == 200 and data[-1] == "[DONE]" and _streamed_text(data) == "abcd", data[-2:]
    assert len(edge.requests) == 4
    phases = [e["phase"] for e in await _phases(http, edge.url, "held-then-back")]
    assert "queued" in phases and phases[-1] == "completed", phases


@pytest.mark.parametrize(("held_s", "asks"), [(0.0, None), (30.0, 1)], ids=["never-back", "held-longer"])
async def test_a_held_node_that_does_not_come_back_is_a_structured_503(
    edge: Edge, http: aiohttp.ClientSession, held_s: float, asks: int | None
) -> None:
    """The tracker keeps refusing for a held node: the request fails with a 503 `no_coverage`
    naming it once LOST_NODE_WAIT_S after the hold passed (a node held out longer than
    HELD_WAIT_MAX_S, lost a third time in 10 minutes, at once)."""
    held = RouteError(code="no_coverage", message="gap (held out after a reported loss: n1)",
                      missing_ranges=[(15, 30)], held_nodes=["n1"], held_s=held_s)
    edge.route_errors.extend([held] * 1000)
    began = time.monotonic()
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG})
    took = time.monotonic() - began
    edge.route_errors.clear()
    err = orjson.loads(raw)["error"]
    assert status == 503 and err["code"] == "no_coverage" and "n1" in err["message"], err
    if asks is None:
        assert LOST_NODE_WAIT_S <= took < LOST_NODE_WAIT_S + 3, took
    else:
        assert len(edge.requests) == asks, len(edge.requests)


def test_no_node_of_the_model_does_not_only_blame_loading() -> None:
    """The tracker knows no node of the model also when every one was lost (all replicas of a
    range frozen or killed): the hint 'nodes may still be loading' alone sent an operator the
    wrong way after a loss."""
    err = route_error_to_api(RouteError(code="unknown_model", message="?"), "bundled")
    assert "loading" in str(err) and "lost" in str(err) and "retry shortly" in str(err)


async def test_a_gateway_whose_revision_no_node_serves_is_told_so(edge: Edge, http: aiohttp.ClientSession) -> None:
    """Live nodes serve the same model from another GGUF (another quantization): the tracker
    knows no node of the gateway's revision, and waiting will not change that, so the answer
    names both revisions and carries no Retry-After."""
    cap = _capability(edge_model_path := Path(edge.tokenizer.path), 0, 30).model_copy(
        update={"model_name": model_id(edge_model_path), "model_revision": "0123456789abcdef"})
    await _announce_unknown_model(edge, "other", cap)
    got, headers, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG})
    error = orjson.loads(raw)["error"]
    assert got == 503 and error["code"] == "revision_mismatch" and "Retry-After" not in headers
    assert headers.get("x-should-retry") == "false"  # an OpenAI SDK would otherwise ask twice more, in vain
    assert "0123456789abcdef" in error["message"] and model_revision(edge_model_path) in error["message"]


async def _announce_unknown_model(edge: Edge, node_id: str, cap: CapabilityReport) -> None:
    """A live node `node_id` serving `cap`'s model, heard by the gateway, and a tracker that
    answers the next route ask unknown_model."""
    await edge.node_bus.publish(subjects.node_announce(node_id), NodeAnnouncement(
        node_id=node_id, activation_url="http://127.0.0.1:9", capability=cap, started_at=0.0))
    await edge.node_bus.flush()
    edge.route_errors.append(RouteError(code="unknown_model", message="?"))
    for _ in range(100):  # the gateway hears the announcement on its own schedule
        if any(a.node_id == node_id for a in edge.runner.app[MESH].live()):
            break
        await asyncio.sleep(0.05)


async def test_a_gateway_whose_model_no_node_serves_names_the_models_they_do(
        edge: Edge, http: aiohttp.ClientSession) -> None:
    """Nodes serve only another model (the gateway was started with the wrong --model): the
    answer was 'still loading, retry shortly' and nothing else, however long the user retried.
    It still is a 503 with Retry-After (the gateway's nodes may be loading), naming what the
    live nodes serve."""
    cap = _capability(Path(edge.tokenizer.path), 0, 30).model_copy(
        update={"model_name": "someone-elses-model", "model_revision": "fedcba9876543210"})
    await _announce_unknown_model(edge, "elsewhere", cap)
    got, headers, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG})
    error = orjson.loads(raw)["error"]
    assert got == 503 and error["code"] == "no_nodes" and headers["Retry-After"] == "2"
    assert "someone-elses-model (fedcba9876543210)" in error["message"] and "retry shortly" in error["message"]


async def test_telemetry_waits_then_gives_up_and_rejects_bad_ids(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{edge.url}/v1/sessions/not-yet/events") as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert b"event: error" in raw and b"session_not_found" in raw
    async with http.get(f"{edge.url}/v1/sessions/bad.id/events") as resp:
        assert resp.status == 400
    async with http.get(f"{edge.url}/v1/sessions/x/events",
                        headers={"Last-Event-ID": "abc"}) as resp:
        assert resp.status == 400


async def test_bus_telemetry_is_published_and_throttled(
    edge: Edge, http: aiohttp.ClientSession, nats_server: NatsServer
) -> None:
    edge.script.tokens = _byte_tokens(edge.tokenizer, "x" * 60)
    monitor = await Bus.connect(nats_server.url, role="monitor", name="monitor")
    got: list[GenerationTelemetry] = []
    try:
        async with monitor.subscribe(subjects.session_telemetry("bus-tele"),
                                     GenerationTelemetry) as sub:
            status, _, _ = await _post(http, edge.url, {
                "model": "bundled", "messages": MSG, "max_tokens": 60},
                headers={"x-route-session-id": "bus-tele"})
            assert status == 200
            while not got or got[-1].phase != "completed":
                got.append(await sub.next())
    finally:
        await monitor.close()
    phases = [e.phase for e in got]
    for phase in ("queued", "routing", "prefill", "decode", "finalizing", "completed"):
        assert phase in phases
    async with http.get(f"{edge.url}/v1/sessions/bus-tele") as resp:
        local = await resp.json()
    # the hub emitted every decode token locally (interval 0) but the bus got fewer
    assert local["generated_tokens"] == 60 and got[-1].generated_tokens == 60
    assert got[-1].seq == local["seq"] and len(got) < local["seq"] / 2


async def test_telemetry_streams_are_bounded(edge: Edge) -> None:
    async with aiohttp.ClientSession() as a, aiohttp.ClientSession() as b:
        first = await a.get(f"{edge.url}/v1/telemetry")
        second = await b.get(f"{edge.url}/v1/telemetry")
        assert first.status == second.status == 200
        async with aiohttp.ClientSession() as c, c.get(f"{edge.url}/v1/telemetry") as third:
            assert third.status == 429 and third.headers["Retry-After"] == "5"
            assert (await third.json())["error"]["code"] == "too_many_streams"
        first.close()
        second.close()
    async with aiohttp.ClientSession() as d:
        while True:  # the gateway notices the closed streams at its next keep-alive
            async with d.get(f"{edge.url}/v1/sessions/x/events") as resp:
                if resp.status == 200:
                    break
                assert resp.status == 429
            await asyncio.sleep(0.05)


async def test_shutdown_ends_open_sse_streams(edge: Edge) -> None:
    async with aiohttp.ClientSession() as own:
        resp = await own.get(f"{edge.url}/v1/telemetry")
        reader = asyncio.create_task(resp.read())
        await asyncio.sleep(0.2)
        assert not reader.done()
        await edge.runner.cleanup()  # the gateway stops; the stream must end, not hang
        with contextlib.suppress(aiohttp.ClientPayloadError):
            await reader
        resp.close()


@pytest.mark.parametrize(
    "messages",
    [
        MSG,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? é😀"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "And then?"}],
    ],
)
def test_template_and_ids_match_llama_cpp_python(
    tokenizer: ModelTokenizer, messages: list[dict[str, str]]
) -> None:
    import llama_cpp
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    llm = llama_cpp.Llama(model_path=str(tokenizer.path), vocab_only=True, verbose=False)
    try:
        fmt = Jinja2ChatFormatter(
            template=llm.metadata["tokenizer.chat_template"],
            eos_token=llm._model.token_get_text(llm.token_eos()),
            bos_token=llm._model.token_get_text(llm.token_bos()))
        expected = fmt(messages=messages)
        ids = llm.tokenize(expected.prompt.encode(), add_bos=not expected.added_special,
                           special=True)
    finally:
        llm.close()
    assert tokenizer.render_chat(messages) == expected.prompt
    assert tokenizer.encode_chat(messages) == ids


@pytest.mark.parametrize("bad", [{"seed": -2}, {"seed": 1.5}, {"seed": True},
                                 {"temperature": 2.5}, {"top_p": 0}])
async def test_bad_sampling_is_400_before_any_route(
    edge: Edge, http: aiohttp.ClientSession, bad: dict[str, Any]
) -> None:
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, **bad})
    err = orjson.loads(raw)["error"]
    assert status == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == next(iter(bad)) and err["code"] == "invalid_value"
    assert edge.requests == [] and edge.script.opened == []  # no route was asked for


async def test_the_ledger_endpoint_says_when_no_ledger_runs_then_shows_it(
        edge: Edge, http: aiohttp.ClientSession, nats_server: NatsServer) -> None:
    async with http.get(f"{edge.url}/v1/ledger") as resp:  # no tracker ever kept one on this server
        err = (await resp.json())["error"]
    assert resp.status == 503 and err["code"] == "no_ledger"
    assert err["type"] == "service_unavailable" and "param" in err and err["message"]  # the OpenAI error body
    from gateway.validation import validation_event
    from schemas.audit import NodeWork, RouteParticipation
    from tracker.service import Tracker, TrackerConfig

    tbus = await Bus.connect(nats_server.url, role="tracker", name="ledger-tracker")
    gbus = await Bus.connect(nats_server.url, role="gateway", name="ledger-gateway")
    try:
        async with Tracker(tbus, TrackerConfig(ledger=True)) as tracker:
            await tbus.publish_audit(RouteParticipation(  # the tracker vouches for the hop first
                source="tracker", session_id="s", route_id="r", model="x", model_revision="x", cache_abi="x",
                node_id="fake-node", layer_start=0, layer_end=15, hop_index=0, n_hops=2))
            hop = Hop(node_id="fake-node", activation_url="http://127.0.0.1:9", layer_start=0, layer_end=15)
            await gbus.publish_audit(validation_event(  # and the gateway counted the session's tokens
                RouteSession(session_id="s", route_id="r", model="x", model_revision="x", cache_abi="x", n_layer=30,
                             hidden_size=8, n_ctx=256, hops=[hop]),
                prompt_ids=range(7), output_ids=range(4), finish_reason="stop"))
            await edge.node_bus.publish_audit(NodeWork(
                source="fake-node", node_id="fake-node", session_id="s", route_id="r", model_revision="x",
                layer_start=0, layer_end=15, prefill_tokens=7, decode_tokens=3, active_param_bytes=10**9))
            for _ in range(600):
                if tracker.ledger is not None and tracker.ledger.state.events:
                    break
                await asyncio.sleep(0.05)
            async with http.get(f"{edge.url}/v1/ledger") as resp:
                body = await resp.json()
            assert resp.status == 200
            [node] = body["nodes"]
            assert (node["node_id"], node["prefill_work"], node["decode_work"]) == ("fake-node", 7.0, 3.0)
    finally:
        await gbus.close()
        await tbus.close()


async def test_a_client_picks_a_public_or_private_route_and_is_told_which(
        edge: Edge, http: aiohttp.ClientSession) -> None:
    from gateway.chat_request import route_policy_wanted
    from schemas.route import RoutePolicy

    await edge.announce()
    edge.script.tokens = _byte_tokens(edge.tokenizer, "ok")
    status, headers, _ = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "max_tokens": 2})
    assert status == 200 and headers["x-meshnet-route-policy"] == "public"
    assert edge.requests[-1].policy.kind == "public"
    # a header, or a body field the OpenAI SDK passes through extra_body
    status, headers, _ = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "max_tokens": 2},
                                     headers={"x-meshnet-route-policy": "private",
                                              "x-meshnet-allow-nodes": "head, tail"})
    assert status == 200 and headers["x-meshnet-route-policy"] == "private"
    assert (edge.requests[-1].policy.kind, edge.requests[-1].policy.allow_nodes) == ("private", ["head", "tail"])
    body = {"model": "bundled", "messages": MSG, "max_tokens": 2, "stream": True,
            "route_policy": {"kind": "private", "allow_nodes": ["head", "tail"]}}
    async with http.post(f"{edge.url}/v1/chat/completions", json=body) as resp:
        assert resp.headers["x-meshnet-route-policy"] == "private"
        sid = resp.headers["x-route-session-id"]
        await resp.read()
    assert edge.requests[-1].policy.allow_nodes == ["head", "tail"]
    async with http.get(f"{edge.url}/v1/sessions/{sid}") as resp:
        assert (await resp.json())["route_policy"] == "private"  # telemetry says it too
    # nonsense is a 400 naming the field, never a route nobody may serve
    for headers in ({"x-meshnet-route-policy": "secret"}, {"x-meshnet-route-policy": "private"}):
        status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG}, headers=headers)
        assert status == 400 and orjson.loads(raw)["error"]["code"] == "invalid_value", headers
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG,
                                                  "route_policy": {"kind": "private"}})
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "route_policy"
    private = RoutePolicy(kind="private", allow_nodes=["a"])
    assert route_policy_wanted(None, None, None, private) == private  # the gateway's default
    assert route_policy_wanted(None, None, "b,c", private).allow_nodes == ["b", "c"]


@pytest.mark.parametrize("headers", [
    [("x-meshnet-route-policy", "private"), ("x-meshnet-route-policy", "public")],
    [("x-meshnet-restart", "off"), ("x-meshnet-restart", "on")],
    [("x-meshnet-validate", "on"), ("x-meshnet-validate", "off")],
    [("x-meshnet-speculative", "off"), ("x-meshnet-speculative", "on")],
    [("x-route-session-id", "dup-a"), ("x-route-session-id", "dup-b")],
    [("Authorization", "Bearer sk-a"), ("Authorization", "Bearer sk-b")],
], ids=lambda h: h[0][0])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_meshnet_header_sent_twice_with_different_values_is_a_400_naming_it(
        edge: Edge, http: aiohttp.ClientSession, headers: list[tuple[str, str]], path: str) -> None:
    """Two x-meshnet-route-policy headers, private then public: the request ran on the first
    one's policy, the other silently dropped (request.headers.get); two different session ids or
    Authorization headers the same. Which one the client meant cannot be known: a 400."""
    await edge.announce()
    body = {"model": "bundled", "max_tokens": 2, **({"messages": MSG} if "chat" in path else {"prompt": "hi"})}
    async with http.post(f"{edge.url}{path}", json=body, headers=CIMultiDict(headers)) as resp:
        status, err = resp.status, (await resp.json())["error"]
    assert (status, err["type"], err["code"], err["param"]) == (
        400, "invalid_request_error", "duplicate_header", headers[0][0]), err
    assert "sent 2 times with different values" in err["message"] and "sk-" not in err["message"]
    assert edge.requests == []  # no route was asked for


async def test_a_meshnet_header_repeated_with_one_value_is_that_value_and_allow_lists_add_up(
        edge: Edge, http: aiohttp.ClientSession) -> None:
    """Copies that agree (a proxy that repeats a header; a word's case) are one value; the
    copies of x-meshnet-allow-nodes, a comma-separated list, are one list (RFC 9110, 5.3)."""
    await edge.announce()
    edge.script.tokens = _byte_tokens(edge.tokenizer, "ok")
    headers = CIMultiDict([("x-meshnet-route-policy", "private"), ("x-meshnet-route-policy", "Private "),
                           ("x-meshnet-allow-nodes", "head"), ("x-meshnet-allow-nodes", "tail"),
                           ("x-route-session-id", "dup-same"), ("x-route-session-id", "dup-same")])
    status, got, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "max_tokens": 2},
                                   headers=headers)  # type: ignore[arg-type]
    assert status == 200, raw
    assert got["x-route-session-id"] == "dup-same" and got["x-meshnet-route-policy"] == "private"
    assert (edge.requests[-1].policy.kind, edge.requests[-1].policy.allow_nodes) == ("private", ["head", "tail"])


async def test_a_route_that_breaks_in_an_unexpected_way_ends_the_stream_with_an_error(
        edge: Edge, http: aiohttp.ClientSession) -> None:
    """The scripted route runs out of tokens (an IndexError inside the route's driver): the
    client gets the route_failed error chunk and the session ends, never a stream that hangs."""
    await edge.announce()
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abc")
    async with asyncio.timeout(60):  # a guard: before, the session waited forever
        status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "stream": True,
                                                      "max_tokens": 8})
    data = _sse_data(raw)
    assert status == 200 and "route_failed" in data[-1] and "IndexError" in data[-1], data
    assert edge.script.released == edge.script.opened


async def test_shutdown_ends_a_chat_stream_with_an_error_and_done(edge: Edge) -> None:
    """A chat stream cut by the gateway's shutdown says so (`shutting_down`) and ends with
    `[DONE]`, instead of a connection that just closes."""
    await edge.announce()
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    edge.script.hang_after = 2  # the route stops answering: the stream stays open
    got: list[bytes] = []
    async with aiohttp.ClientSession() as own:
        for _ in range(200):  # the announcements reach the gateway's mesh view asynchronously
            async with own.get(f"{edge.url}/v1/models") as r:
                if (await r.json())["data"]:
                    break
            await asyncio.sleep(0.05)
        body = {"model": "bundled", "messages": MSG, "stream": True, "max_tokens": 8}
        resp = await own.post(f"{edge.url}/v1/chat/completions", json=body)
        assert resp.status == 200
        while len([g for g in got if g.startswith(b"data: {")]) < 3:
            got.append(await asyncio.wait_for(resp.content.readline(), 30))
        await edge.runner.cleanup()
        with contextlib.suppress(aiohttp.ClientPayloadError):
            got.extend([line async for line in resp.content])
        resp.close()
    data = [line[6:].strip() for line in got if line.startswith(b"data: ")]
    assert data[-1] == b"[DONE]", data
    assert orjson.loads(data[-2])["error"]["code"] == "shutting_down", data


async def test_shutdown_ends_a_stream_of_several_choices_with_an_error_and_done(
        edge: Edge, monkeypatch: pytest.MonkeyPatch) -> None:
    """n > 1: the gateway's shutdown stops the stream at once with `shutting_down` and `[DONE]`,
    as one choice's stream (before: it was not among the streams shutdown stops, so it ran on
    until it finished or the server's shutdown timeout cut the connection with no error)."""
    slow_step = ScriptedRoute.decode

    async def slow(self: ScriptedRoute, token_id: int) -> FrameResult:
        await asyncio.sleep(0.05)  # 200 tokens: 10 s, far longer than the shutdown may take
        return await slow_step(self, token_id)

    monkeypatch.setattr(ScriptedRoute, "decode", slow)
    await edge.announce()
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh" * 30)
    got: list[bytes] = []
    async with aiohttp.ClientSession() as own:
        for _ in range(200):  # the announcements reach the gateway's mesh view asynchronously
            async with own.get(f"{edge.url}/v1/models") as r:
                if (await r.json())["data"]:
                    break
            await asyncio.sleep(0.05)
        body = {"model": "bundled", "messages": MSG, "stream": True, "max_tokens": 200, "n": 2}
        resp = await own.post(f"{edge.url}/v1/chat/completions", json=body)
        assert resp.status == 200
        while len([g for g in got if g.startswith(b"data: {")]) < 6:
            got.append(await asyncio.wait_for(resp.content.readline(), 30))
        async with asyncio.timeout(5):
            await edge.runner.cleanup()
        with contextlib.suppress(aiohttp.ClientPayloadError):
            got.extend([line async for line in resp.content])
        resp.close()
    data = [line[6:].strip() for line in got if line.startswith(b"data: ")]
    assert data[-1] == b"[DONE]", data[-2:]
    assert orjson.loads(data[-2])["error"]["code"] == "shutting_down", data[-2:]


async def test_a_batch_prompt_that_cannot_fit_is_a_400_before_any_route(
        edge: Edge, http: aiohttp.ClientSession) -> None:
    """A later prompt of a /v1/completions batch is checked against the context as the first
    one is: a 400 naming `prompt[2]`, the one at fault (before: `prompt`, whichever it was),
    before any route is asked for (before: the earlier choices ran, and on a real mesh the long
    one waited out the admission queue for a 503), and no choice's session is left open in telemetry."""
    await edge.announce()  # the route's context: 256 tokens
    body = {"model": "bundled", "prompt": ["hello", "hello", "word " * 300], "max_tokens": 2}
    async with http.post(f"{edge.url}/v1/completions", json=body, headers={"x-route-session-id": "batch-1"}) as resp:
        status, err = resp.status, (await resp.json())["error"]
    assert (status, err["code"], err["param"]) == (400, "context_length_exceeded", "prompt[2]"), err
    assert "prompt[2]" in err["message"], err
    assert edge.requests == [] and edge.script.opened == []  # no route was asked for
    for sid in ("batch-1", "batch-1-n1"):
        async with http.get(f"{edge.url}/v1/sessions/{sid}") as resp:
            assert (await resp.json())["phase"] == "failed", sid


@pytest.mark.parametrize(("prompt", "param", "code"), [
    (["word " * 300, "hello"], "prompt[0]", "context_length_exceeded"),  # the first: checked at admission
    (["hello", "x" * 100_000], "prompt[1]", "context_length_exceeded"),  # refused before it is tokenized
    ([[1, 2], [1, 10**9]], "prompt[1]", "invalid_value"),  # a token id beyond the vocabulary
    ("word " * 300, "prompt", "context_length_exceeded"),  # no batch: the prompt
])
async def test_a_batch_prompt_refused_is_named_by_its_index(
        edge: Edge, http: aiohttp.ClientSession, prompt: object, param: str, code: str) -> None:
    await edge.announce()  # the route's context: 256 tokens
    body = {"model": "bundled", "prompt": prompt, "max_tokens": 2}
    async with http.post(f"{edge.url}/v1/completions", json=body) as resp:
        status, err = resp.status, (await resp.json())["error"]
    assert (status, err["code"], err["param"]) == (400, code, param), err
    assert edge.requests == [] and edge.script.opened == []  # no route was asked for


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_inside_a_call_list_never_shows_its_wrapper(
        edge: Edge, http: aiohttp.ClientSession, stream: bool) -> None:
    """A stop string that cuts a (JSON fallback) call list ends the answer as max_tokens does:
    the calls it completed, never the `{"tool_calls"` wrapper as content (before: the cut
    markup was the message's content, as if the model had ended it)."""
    await edge.announce()
    edge.script.tokens = _byte_tokens(edge.tokenizer, '{"tool_calls": [{"name": "f", "arguments": {"city": "Paris"}}]}')
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "tools": tools,
                                                  "stop": ["Paris"], "stream": stream, "max_tokens": 80})
    assert status == 200
    if stream:
        chunks = [orjson.loads(d) for d in _sse_data(raw)[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        choice = orjson.loads(raw)["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == ("", "stop"), choice


async def test_a_gateway_whose_bus_is_lost_for_good_stops(edge: Edge) -> None:
    """nats-py gives up on a server -ERR it does not retry: without a bus the gateway routes
    nothing, so `meshnet gateway` stops (its LOST_HOOK: SIGTERM to itself) and exits 1."""
    state = edge.runner.app[BUS_STATE]
    stopped = asyncio.Event()
    state[LOST_HOOK] = stopped.set
    bus = state["bus"]
    assert isinstance(bus, Bus)
    await bus._nc._process_err("'Maximum Control Line Exceeded'")  # what nats-py does with that -ERR
    await asyncio.wait_for(stopped.wait(), 10)
    assert state["lost"] is True
