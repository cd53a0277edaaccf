"""A client that reads slowly, or stops reading, is the client's business, not the route's.

A Generation's route runs on in its own task while the client is slow to take the tokens; the
stall watchdog watches the route, so a client that pauses longer than the stall deadline never
makes a working route count as stalled (before, it did: the session then failed with
`hop_stalled`, or restarted on a new route it did not need)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.errors import RouteFailedApiError
from gateway.generation import Delta, Finished, Generation, GenerationPlan
from gateway.metrics import GatewayMetrics
from gateway.telemetry import SessionTelemetry
from gateway.tokenizer import ModelTokenizer
from schemas.frames import FrameResult, RouteFailedError
from schemas.route import Hop, RouteFailure, RouteSession
from tests.test_abuse_gateway import _ready
from tests.test_gateway_api import MSG, Edge, _byte_tokens, edge, http, tokenizer  # noqa: F401  (fixtures)

STEP_S = 0.01  # the route's decode step
STALL_S = 0.3  # the stall deadline of the test's sessions
PROMPT = [1, 2, 3]


class SteadyRoute:
    """A route that answers one token every STEP_S and, like RouteClient, fails its Decode Run
    with the failure it was interrupted with."""

    def __init__(self, session: RouteSession, tokens: list[int]) -> None:
        self.session = session
        self.tokens = tokens
        self.interrupted: RouteFailure | None = None
        self.used_rows: int | None = None
        self.results_ready = False
        self.i = 0

    async def __aenter__(self) -> SteadyRoute:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    chunk_size = 512

    async def hop_marks(self, timeout: float) -> tuple[tuple[int, ...] | None, ...]:
        return ((0, 0, 0),)

    def interrupt(self, failure: RouteFailure) -> None:
        self.interrupted = failure

    def _result(self) -> FrameResult:
        if self.interrupted is not None:
            raise RouteFailedError(self.interrupted)
        self.i += 1
        return FrameResult(token_id=self.tokens[self.i - 1], position=self.i)

    async def prefill(self, token_ids: Sequence[int], on_progress: Callable[[int, int], object] | None = None,
                      stepwise_from: int | None = None) -> FrameResult:
        self.i = len(token_ids) - len(PROMPT)  # a restart's route goes on after what it rebuilt
        return self._result()

    async def decode(self, token_id: int) -> FrameResult:
        raise NotImplementedError

    async def decode_run(self, token_id: int, steps: int, stop_ids: Iterable[int] = (),
                         flush_ms: int = 0, draft: int = 0) -> AsyncGenerator[FrameResult, None]:
        for _ in range(steps):
            await asyncio.sleep(STEP_S)
            yield self._result()


def _generation(tok: ModelTokenizer, text: str, *, max_restarts: int = 0) -> Generation:
    tokens = _byte_tokens(tok, text)
    session = RouteSession(session_id="s", route_id="r", model="x", model_revision="x", cache_abi="x",
                           n_layer=30, hidden_size=576, n_ctx=4096,
                           hops=[Hop(node_id="n", activation_url="http://127.0.0.1:9", layer_start=0, layer_end=30)])
    return Generation(
        GenerationPlan(session, PROMPT, max_tokens=len(tokens), stall_s=STALL_S, max_restarts=max_restarts),
        tokens=tok, open_route=lambda s: SteadyRoute(s, tokens),
        telemetry=SessionTelemetry("s", "x", lambda *_: None), metrics=GatewayMetrics(), started=0.0)


async def test_a_client_that_pauses_longer_than_the_stall_deadline_gets_the_whole_answer(
        tokenizer: ModelTokenizer) -> None:  # noqa: F811
    """The client takes 5 tokens, then reads nothing for 4 stall deadlines while the route keeps
    answering (it needs ~2 s for its 200 tokens): the answer completes on its one route."""
    text = "The lighthouse keeper counted the ships. " * 5
    generation = _generation(tokenizer, text)
    shown: list[str] = []
    finished: Finished | None = None
    try:
        async for ev in generation.run():
            if isinstance(ev, Delta):
                shown.append(ev.text)
                if len(shown) == 5:
                    await asyncio.sleep(4 * STALL_S)  # a client that reads nothing for a while
            else:
                finished = ev
    except RouteFailedApiError as exc:  # before: "no progress for 0.3 s (the stall deadline)"
        raise AssertionError(f"a slow client failed a working route: {exc.message}") from exc
    assert finished is not None and finished.finish_reason == "length"
    assert "".join(shown) == text and generation.record.restarts == 0 and len(generation.routes) == 1


async def test_a_slow_client_with_restarts_on_keeps_its_route(tokenizer: ModelTokenizer) -> None:  # noqa: F811
    """With restarts allowed, the same pause never moved the session to a new route either."""
    text = "Count the ships: one, two, three, four, five, six. " * 4
    generation = _generation(tokenizer, text, max_restarts=2)
    shown: list[str] = []
    async for ev in generation.run():
        if isinstance(ev, Delta):
            shown.append(ev.text)
            if len(shown) in (3, 60):
                await asyncio.sleep(4 * STALL_S)
    assert "".join(shown) == text and generation.record.restarts == 0 and len(generation.routes) == 1


# -- a client that goes while the gateway waits to write to it ----------------------------------


def _write_then(writes: int, after: Callable[[], Awaitable[None]]) -> Callable[..., Any]:
    """StreamResponse.write that, after `writes` SSE writes, runs `after` instead of writing."""
    real = web.StreamResponse.write
    done = [0]

    async def write(self: web.StreamResponse, data: bytes) -> None:
        if self.content_type == "text/event-stream":
            done[0] += 1
            if done[0] > writes:
                await after()
        await real(self, data)

    return write


def _lost_after(writes: int) -> Callable[..., Any]:
    """StreamResponse.write as aiohttp behaves when a client that stopped reading (the gateway's
    write waits for the socket to drain) drops its connection: after `writes` SSE writes, the
    waiting write raises a plain ConnectionError("Connection lost"), not a ConnectionResetError."""
    async def lost() -> None:
        raise ConnectionError("Connection lost")
    return _write_then(writes, lost)


async def test_a_client_lost_during_a_stalled_write_is_a_client_gone(
        edge: Edge, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    """The stream ends as a client that left (counted `client_gone`, its session failed with
    "client disconnected", the route released), not as an error of the handler that aiohttp
    logs with its traceback and /metrics counts as a 200."""
    await _ready(edge, http)
    edge.script.tokens = _byte_tokens(edge.tokenizer, "one two three four five six seven")
    monkeypatch.setattr(web.StreamResponse, "write", _lost_after(3))
    caplog.set_level(logging.ERROR, logger="aiohttp.server")
    body = {"model": "bundled", "messages": MSG, "stream": True, "max_tokens": 30}
    async with http.post(f"{edge.url}/v1/chat/completions", json=body,
                         headers={"x-route-session-id": "gone-1"}) as resp:
        assert resp.status == 200
        with contextlib.suppress(aiohttp.ClientPayloadError):  # the stream was cut
            await resp.read()
    async with http.get(f"{edge.url}/v1/sessions/gone-1") as r:
        state = await r.json()
    assert state["phase"] == "failed" and "disconnect" in state["failure_reason"]
    async with http.get(f"{edge.url}/metrics") as r:
        metrics = await r.text()
    assert 'meshnet_gateway_requests_total{outcome="client_gone"} 1' in metrics
    assert 'outcome="200"' not in metrics
    assert edge.script.released == edge.script.opened == ["gone-1"]
    assert not [r for r in caplog.records if r.name == "aiohttp.server"]


@pytest.mark.parametrize("path", ["/v1/telemetry", "/v1/mesh/events", "/v1/sessions/gone-2/events"])
async def test_a_telemetry_stream_lost_during_a_stalled_write_ends_quietly(
        edge: Edge, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        caplog: pytest.LogCaptureFixture, path: str) -> None:
    await _ready(edge, http)
    monkeypatch.setattr(web.StreamResponse, "write", _lost_after(1))  # after the opening comment
    caplog.set_level(logging.ERROR, logger="aiohttp.server")
    async with http.get(f"{edge.url}{path}") as resp:
        assert resp.status == 200
        with contextlib.suppress(aiohttp.ClientPayloadError):  # the stream was cut
            await resp.read()
    assert not [r for r in caplog.records if r.name == "aiohttp.server"]


# -- a client that stops reading ------------------------------------------------------------------

WRITE_TIMEOUT = 0.5


@pytest.fixture
def gateway_overrides() -> dict[str, Any]:
    return {"write_timeout": WRITE_TIMEOUT}


def _stuck_after(writes: int) -> Callable[..., Any]:
    """StreamResponse.write as it behaves for a client that stopped reading once its socket's
    buffers are full: after `writes` SSE writes, a write waits for ever."""
    return _write_then(writes, asyncio.Event().wait)


@pytest.mark.parametrize("n", [1, 2])
async def test_a_client_that_stops_reading_lets_its_route_go(
        edge: Edge, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, n: int) -> None:  # noqa: F811
    """A write the client takes nothing of for `write_timeout` seconds ends the stream as a
    client gone: its connection is dropped and every route it held is released. Before, a
    client that kept its connection open and read nothing held its routes' hops (their Hot KV
    State) and the gateway's session slots for as long as it liked."""
    await _ready(edge, http)
    edge.script.tokens = _byte_tokens(edge.tokenizer, "one two three four five six seven")
    monkeypatch.setattr(web.StreamResponse, "write", _stuck_after(2))
    body = {"model": "bundled", "messages": MSG, "stream": True, "max_tokens": 30, "n": n}
    async with asyncio.timeout(10):
        async with http.post(f"{edge.url}/v1/chat/completions", json=body,
                             headers={"x-route-session-id": f"stuck-{n}"}) as resp:
            assert resp.status == 200
            with contextlib.suppress(aiohttp.ClientPayloadError):  # the gateway dropped the connection
                await resp.read()
        while len(edge.script.released) < n:  # noqa: ASYNC110 - the route's release runs after the answer
            await asyncio.sleep(0.02)
    assert sorted(edge.script.released) == sorted(edge.script.opened)
    async with http.get(f"{edge.url}/v1/sessions/stuck-{n}") as r:
        state = await r.json()
    assert state["phase"] == "failed" or n > 1  # choices run apart from the writes: they may have ended
    async with http.get(f"{edge.url}/metrics") as r:
        metrics = await r.text()
    assert 'meshnet_gateway_requests_total{outcome="client_gone"} 1' in metrics
    assert "meshnet_gateway_active_sessions 0" in metrics
