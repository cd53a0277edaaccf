"""The gateway's admission queue over real HTTP and a real nats-server, with held scripted routes.

Capacity is forced small either at the gateway (`max_sessions`) or at a stand-in tracker that
answers `no_capacity` while its routes are taken; each route holds its session open until the
test releases it, so the queue's state can be watched. The queue over the real model and real
node processes is in test_gateway_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from aiohttp import web

from bus import subjects
from bus.client import Bus
from bus.server import NatsServer, free_port
from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.tokenizer import ModelTokenizer
from schemas.frames import FrameResult
from schemas.route import Hop, RouteError, RouteReply, RouteRequest, RouteSession
from tests.test_gateway_api import MSG, Script, ScriptedRoute

WAIT = 30.0  # bounds every wait; no test asserts on elapsed time


class HeldRoute(ScriptedRoute):
    """A scripted route whose prefill waits until the test releases the held sessions."""

    def __init__(self, session: RouteSession, script: Script, release: asyncio.Event) -> None:
        super().__init__(session, script)
        self.release = release

    async def prefill(self, token_ids: Sequence[int],
                      on_progress: Callable[[int, int], object] | None = None) -> FrameResult:
        await self.release.wait()
        return await super().prefill(token_ids, on_progress)


@dataclass
class QueueEdge:
    url: str
    script: Script
    release: asyncio.Event
    granted: list[str] = field(default_factory=list)  # session ids the tracker gave a route, in order

    async def post(self, http: aiohttp.ClientSession, session_id: str, *, stream: bool = False
                   ) -> tuple[int, dict[str, str], bytes]:
        body = {"model": "bundled", "messages": MSG, "max_tokens": 3, "stream": stream}
        async with http.post(f"{self.url}/v1/chat/completions", json=body,
                             headers={"x-route-session-id": session_id}) as resp:
            return resp.status, dict(resp.headers), await resp.read()

    async def state(self, http: aiohttp.ClientSession, session_id: str) -> dict[str, Any] | None:
        async with http.get(f"{self.url}/v1/sessions/{session_id}") as resp:
            return await resp.json() if resp.status == 200 else None

    async def metric(self, http: aiohttp.ClientSession, name: str) -> float:
        async with http.get(f"{self.url}/metrics") as resp:
            for line in (await resp.text()).splitlines():
                if line.startswith(f"meshnet_gateway_{name} "):
                    return float(line.split()[-1])
        raise AssertionError(f"metric {name} not exposed")


EdgeFactory = Callable[..., Awaitable[QueueEdge]]


@pytest_asyncio.fixture
async def queue_edge(nats_server: NatsServer, model_path: Path) -> AsyncIterator[EdgeFactory]:
    """make(tracker_capacity=None, route_class=HeldRoute, **settings): a gateway whose routes are held
    until released."""
    stack = contextlib.AsyncExitStack()
    tokenizer = ModelTokenizer(model_path)

    async def make(*, tracker_capacity: int | None = None, route_class: type[HeldRoute] = HeldRoute,
                   **overrides: Any) -> QueueEdge:
        release = asyncio.Event()
        script = Script(tokens=[*tokenizer.tokenize("abc"), min(tokenizer.eog_ids)])
        port = free_port()
        edge = QueueEdge(f"http://127.0.0.1:{port}", script, release)
        tracker = await Bus.connect(nats_server.url, role="tracker", name="fake-tracker")
        stack.push_async_callback(tracker.close)

        def route(req: RouteRequest) -> RouteReply:
            held = len(edge.granted) - len(script.released)
            if tracker_capacity is not None and held >= tracker_capacity:
                return RouteReply(error=RouteError(code="no_capacity", message="every slot is taken"))
            edge.granted.append(req.session_id or "")
            hop = Hop(node_id="only", activation_url="http://127.0.0.1:9", layer_start=0, layer_end=30)
            return RouteReply(session=RouteSession(
                session_id=req.session_id or "x", route_id=f"r-{len(edge.granted)}", model=req.model,
                model_revision=req.model, cache_abi="test", n_layer=30, hidden_size=576, n_ctx=256,
                hops=[hop], sampling=req.sampling))

        await tracker.serve(subjects.ROUTE_CREATE, RouteRequest, route)
        settings = GatewaySettings(**{
            "port": port, "nats_url": nats_server.url, "model": str(model_path),
            "decode_event_interval": 0.0, "queue_tick": 0.05, "keepalive": 0.2, **overrides})
        app = create_app(settings, open_route=lambda s: route_class(s, script, release))
        runner = web.AppRunner(app)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        stack.callback(release.set)  # a test that fails early must not leave handlers waiting
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return edge

    async with stack:
        yield make


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll `check` until it holds; fail naming `what` after WAIT seconds."""
    deadline = time.monotonic() + WAIT
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT:g}s waiting for {what}")
        await asyncio.sleep(0.02)


async def queued_at(edge: QueueEdge, http: aiohttp.ClientSession, session_id: str, position: int) -> None:
    async def check() -> bool:
        state = await edge.state(http, session_id)
        return state is not None and state["phase"] == "queued" and state["queue_position"] == position
    await until(check, f"{session_id} polled as queued at position {position}")


async def in_phase(edge: QueueEdge, http: aiohttp.ClientSession, session_id: str, phase: str) -> dict[str, Any]:
    found: dict[str, Any] = {}

    async def check() -> bool:
        state = await edge.state(http, session_id)
        found.update(state or {})
        return state is not None and state["phase"] == phase
    await until(check, f"{session_id} polled in phase {phase}")
    return found


async def follow_telemetry(url: str, events: list[dict[str, Any]], opened: asyncio.Event) -> None:
    """Collect every event of /v1/telemetry into `events` until cancelled."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/telemetry") as resp:
        opened.set()
        async for raw in resp.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("data: "):
                events.append(orjson.loads(line[6:]))


@pytest.mark.parametrize("capacity_at", ["gateway", "tracker"])
async def test_six_requests_over_two_slots_all_complete_and_show_their_queue_positions(
    queue_edge: EdgeFactory, capacity_at: str
) -> None:
    if capacity_at == "gateway":
        edge = await queue_edge(max_sessions=2)
    else:
        edge = await queue_edge(tracker_capacity=2)
    events: list[dict[str, Any]] = []
    opened = asyncio.Event()
    ids = [f"q{i}" for i in range(6)]
    async with aiohttp.ClientSession() as http:
        follower = asyncio.create_task(follow_telemetry(edge.url, events, opened))
        try:
            await asyncio.wait_for(opened.wait(), WAIT)
            requests = []
            for i, sid in enumerate(ids):  # one after another, so the arrival order is known
                requests.append(asyncio.create_task(edge.post(http, sid, stream=i % 2 == 1)))
                if i >= 2:
                    await queued_at(edge, http, sid, i - 1)  # both slots are held: q2 is first
                else:
                    await in_phase(edge, http, sid, "prefill")  # holding a slot
            assert await edge.metric(http, "queue_depth") == 4
            assert await edge.metric(http, "active_sessions") == 2
            edge.release.set()
            results = await asyncio.wait_for(asyncio.gather(*requests), WAIT)

            async def all_completed() -> bool:
                return {e["session_id"] for e in events if e["phase"] == "completed"} == set(ids)
            await until(all_completed, "the telemetry stream to show every session completed")
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
        assert [status for status, _, _ in results] == [200] * 6
        # first come, first served: the queue admits in arrival order; the two requests the release
        # admits at once race to open their routes, so either of them may open first
        for k in range(1, len(ids) + 1):
            assert set(edge.script.opened[:k]) <= set(ids[:k + 1]), edge.script.opened
        assert await edge.metric(http, "queue_depth") == 0
        assert await edge.metric(http, "queue_wait_seconds_count") == 6
    shown = {sid: [e["queue_position"] for e in events if e["session_id"] == sid and e["phase"] == "queued"
                   and e.get("queue_position")] for sid in ids}
    for i, sid in enumerate(ids[2:]):
        assert shown[sid] and shown[sid][0] == i + 1, f"{sid} showed positions {shown[sid]}"
        assert shown[sid] == sorted(shown[sid], reverse=True), f"{sid} moved back: {shown[sid]}"



async def test_clients_that_leave_while_queued_leave_the_queue(queue_edge: EdgeFactory) -> None:
    edge = await queue_edge(max_sessions=1)
    async with aiohttp.ClientSession() as http:
        holder = asyncio.create_task(edge.post(http, "holder"))
        await in_phase(edge, http, "holder", "prefill")
        leavers: list[tuple[asyncio.Task[Any], aiohttp.ClientSession]] = []
        for i, (sid, stream) in enumerate((("gone-stream", True), ("gone-plain", False))):
            own = aiohttp.ClientSession()  # its own connection, so closing it is a disconnect
            leavers.append((asyncio.create_task(edge.post(own, sid, stream=stream)), own))
            await queued_at(edge, http, sid, i + 1)
        stayer = asyncio.create_task(edge.post(http, "stayer"))
        await queued_at(edge, http, "stayer", 3)
        for task, own in leavers:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await own.close()
        await queued_at(edge, http, "stayer", 1)  # both places ahead of it were given up
        for sid in ("gone-stream", "gone-plain"):
            state = await in_phase(edge, http, sid, "failed")
            assert state["last_phase"] == "queued"
            assert state["failure_reason"] == "client disconnected while queued"
        assert await edge.metric(http, "queue_depth") == 1
        edge.release.set()
        results = await asyncio.wait_for(asyncio.gather(holder, stayer), WAIT)
        assert [status for status, _, _ in results] == [200, 200]
    assert edge.script.opened == ["holder", "stayer"]  # the leavers never got a route
    assert edge.granted == ["holder", "stayer"]


async def test_a_full_queue_answers_503_with_retry_after(queue_edge: EdgeFactory) -> None:
    edge = await queue_edge(max_sessions=1, max_queue=2)
    async with aiohttp.ClientSession() as http:
        holder = asyncio.create_task(edge.post(http, "holder"))
        await in_phase(edge, http, "holder", "prefill")
        waiting = []
        for i in range(2):
            waiting.append(asyncio.create_task(edge.post(http, f"w{i}", stream=True)))
            await queued_at(edge, http, f"w{i}", i + 1)
        for stream in (False, True):
            status, headers, raw = await edge.post(http, f"over-{stream}", stream=stream)
            err = orjson.loads(raw)["error"]
            assert status == 503 and headers["Content-Type"].startswith("application/json")
            assert (err["code"], err["type"]) == ("queue_full", "service_unavailable")
            assert int(headers["Retry-After"]) >= 1
            assert headers["x-route-session-id"] == f"over-{stream}"
        assert await edge.metric(http, "queue_depth") == 2  # the refused never took a place
        edge.release.set()
        results = await asyncio.wait_for(asyncio.gather(holder, *waiting), WAIT)
        assert [status for status, _, _ in results] == [200, 200, 200]


async def test_a_refused_request_may_be_retried_under_its_own_session_id(queue_edge: EdgeFactory) -> None:
    """A request the queue refused (it never had a route) leaves its session id free: the retry
    its Retry-After asks for, with the same `x-route-session-id` (as the OpenAI SDK retries a
    503), is served. Before, the refusal's telemetry held the id for 10 minutes: every retry was
    a 409 session_exists. The refusal's own telemetry stays readable until the retry starts."""
    edge = await queue_edge(max_sessions=1, max_queue=0)
    async with aiohttp.ClientSession() as http:
        holder = asyncio.create_task(edge.post(http, "holder"))
        await in_phase(edge, http, "holder", "prefill")
        for stream in (False, True):
            status, _, raw = await edge.post(http, f"mine-{stream}", stream=stream)
            assert status == 503 and orjson.loads(raw)["error"]["code"] == "queue_full"
            state = await edge.state(http, f"mine-{stream}")
            assert state is not None and state["phase"] == "failed" and state["last_phase"] == "queued"
        edge.release.set()
        assert (await asyncio.wait_for(holder, WAIT))[0] == 200
        for stream in (False, True):
            status, _, raw = await asyncio.wait_for(edge.post(http, f"mine-{stream}", stream=stream), WAIT)
            assert status == 200, raw
            assert (await edge.state(http, f"mine-{stream}") or {}).get("phase") == "completed"
        # a session that had a route keeps its id (its hops knew it by that id)
        status, headers, raw = await edge.post(http, "holder")
        assert status == 409 and orjson.loads(raw)["error"]["code"] == "session_exists"
        assert headers.get("x-should-retry") == "false"  # an OpenAI SDK retries a 409 twice, in vain, without it


async def test_a_streamed_request_of_several_choices_refused_by_the_queue_is_a_503(queue_edge: EdgeFactory) -> None:
    """n = 2, streamed, on a full gateway: a 503 queue_full with Retry-After, as one choice gets
    (before: 200, the choices' opening chunks, then an SSE error event, which an OpenAI SDK
    raises as a bare APIError and never retries)."""
    edge = await queue_edge(max_sessions=1, max_queue=0)
    body = {"model": "bundled", "messages": MSG, "max_tokens": 3, "stream": True, "n": 2}
    async with aiohttp.ClientSession() as http:
        holder = asyncio.create_task(edge.post(http, "holder"))
        await in_phase(edge, http, "holder", "prefill")
        async with http.post(f"{edge.url}/v1/chat/completions", json=body) as resp:
            status, headers, raw = resp.status, dict(resp.headers), await resp.read()
        assert status == 503 and orjson.loads(raw)["error"]["code"] == "queue_full", raw
        assert int(headers["Retry-After"]) >= 1
        edge.release.set()
        assert (await asyncio.wait_for(holder, WAIT))[0] == 200
        async with http.post(f"{edge.url}/v1/chat/completions", json=body) as resp:
            status, raw = resp.status, await resp.read()
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw


class FirstChoiceHeld(HeldRoute):
    """Choice 0's route gives its first token at once, the rest only once `more` is set."""

    more = asyncio.Event()

    async def prefill(self, token_ids: Sequence[int],
                      on_progress: Callable[[int, int], object] | None = None) -> FrameResult:
        return await ScriptedRoute.prefill(self, token_ids, on_progress)

    async def decode(self, token_id: int) -> FrameResult:
        if self.session.session_id == "multi":
            await self.more.wait()
        return await super().decode(token_id)


async def test_choices_waiting_for_the_request_own_choices_do_not_expire(queue_edge: EdgeFactory) -> None:
    """n = 2 on `--max-sessions 1`: choice 1 waits for choice 0 to end. When choice 0's answer
    took longer than `--queue-timeout`, choice 1's wait expired and the whole request was a 503
    queue_timeout (whose retry fails the same way) after choice 0 had been computed."""
    FirstChoiceHeld.more = asyncio.Event()
    edge = await queue_edge(max_sessions=1, queue_timeout=0.3, route_class=FirstChoiceHeld)
    body = {"model": "bundled", "messages": MSG, "max_tokens": 3, "n": 2}
    async with aiohttp.ClientSession() as http:
        post = asyncio.create_task(http.post(f"{edge.url}/v1/chat/completions", json=body,
                                             headers={"x-route-session-id": "multi"}))
        await queued_at(edge, http, "multi-n1", 1)  # after choice 0's first token
        await asyncio.sleep(1.0)  # over three queue timeouts
        assert (await edge.state(http, "multi-n1") or {}).get("phase") == "queued"
        FirstChoiceHeld.more.set()
        resp = await asyncio.wait_for(post, WAIT)
        answer = orjson.loads(await resp.read())
    assert resp.status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert edge.script.opened == ["multi", "multi-n1"]


async def test_an_expired_wait_answers_503_with_retry_after(queue_edge: EdgeFactory) -> None:
    edge = await queue_edge(tracker_capacity=1, queue_timeout=0.3)
    async with aiohttp.ClientSession() as http:
        holder = asyncio.create_task(edge.post(http, "holder"))
        await in_phase(edge, http, "holder", "prefill")
        for stream in (False, True):
            status, headers, raw = await edge.post(http, f"late-{stream}", stream=stream)
            err = orjson.loads(raw)["error"]
            assert status == 503 and err["code"] == "queue_timeout", err
            assert err["type"] == "service_unavailable" and "0.3s" in err["message"]
            assert int(headers["Retry-After"]) == 1  # at most the queue timeout, rounded up
            state = await in_phase(edge, http, f"late-{stream}", "failed")
            assert state["last_phase"] == "queued" and state["queue_position"] is None
        assert await edge.metric(http, "queue_depth") == 0
        edge.release.set()
        status, _, _ = await asyncio.wait_for(holder, WAIT)
        assert status == 200
        async with http.get(f"{edge.url}/metrics") as resp:
            text = await resp.text()
    assert 'meshnet_gateway_requests_total{outcome="503"} 2' in text
    assert "meshnet_gateway_queue_wait_seconds_count 3" in text


async def test_a_burst_is_admitted_as_far_as_there_is_room(queue_edge: EdgeFactory) -> None:
    """Ten requests at once, eight free places and a queue of two: none is refused (before,
    every request queued first, so eight of them got 503 queue_full with every place free)."""
    edge = await queue_edge(max_sessions=8, max_queue=2)
    async with aiohttp.ClientSession() as http:
        burst = [asyncio.create_task(edge.post(http, f"b{i}")) for i in range(10)]

        async def settled() -> bool:
            return (await edge.metric(http, "active_sessions") == 8
                    and await edge.metric(http, "queue_depth") == 2)
        await until(settled, "eight sessions running and two waiting")
        assert not any(t.done() for t in burst)  # nobody was refused
        status, headers, raw = await edge.post(http, "one-too-many")
        assert status == 503 and orjson.loads(raw)["error"]["code"] == "queue_full"
        assert int(headers["Retry-After"]) >= 1
        edge.release.set()
        results = await asyncio.wait_for(asyncio.gather(*burst), WAIT)
    assert [status for status, _, _ in results] == [200] * 10


async def test_one_api_keys_flood_leaves_another_key_a_place_and_its_turn(queue_edge: EdgeFactory) -> None:
    """Two keys share a gateway of one place and a queue of 4. Key A holds the place and floods:
    its third waiting request is refused (its share is 2), and key B's request, arriving last,
    is served right after A's first waiting one. Before, A's requests took all 4 places, B got
    503 queue_full, and with a place it waited behind every one of A's."""
    edge = await queue_edge(max_sessions=1, max_queue=4, api_keys=("key-a", "key-b"))
    auth = {name: {"Authorization": f"Bearer key-{name}"} for name in ("a", "b")}
    async with aiohttp.ClientSession(headers=auth["a"]) as a, aiohttp.ClientSession(headers=auth["b"]) as b:
        tasks = [asyncio.create_task(edge.post(a, "a-holder"))]
        await in_phase(edge, a, "a-holder", "prefill")
        for i in range(2):
            tasks.append(asyncio.create_task(edge.post(a, f"a-{i}")))
            await queued_at(edge, a, f"a-{i}", i + 1)
        status, headers, raw = await edge.post(a, "a-over")
        err = orjson.loads(raw)["error"]
        assert status == 503 and err["code"] == "queue_full" and "Retry-After" in headers
        assert "this API key already has 2 requests waiting, its share of the 4 places" in err["message"]
        tasks.append(asyncio.create_task(edge.post(b, "b-0")))
        await queued_at(edge, b, "b-0", 2)
        await queued_at(edge, a, "a-1", 3)  # moved back one place
        edge.release.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
    assert [status for status, _, _ in results] == [200, 200, 200, 200]
    assert edge.granted == ["a-holder", "a-0", "b-0", "a-1"]


async def test_an_open_gateway_keeps_arrival_order_whatever_token_a_client_sends(queue_edge: EdgeFactory) -> None:
    """Without --api-key a Bearer token is anyone's choice: a fresh token must not buy a place
    ahead of the requests already waiting (it would, were tokens owners of fair shares)."""
    edge = await queue_edge(max_sessions=1, max_queue=4)
    auth = {name: {"Authorization": f"Bearer token-{name}"} for name in ("a", "b")}
    async with aiohttp.ClientSession(headers=auth["a"]) as a, aiohttp.ClientSession(headers=auth["b"]) as b:
        tasks = [asyncio.create_task(edge.post(a, "a-holder"))]
        await in_phase(edge, a, "a-holder", "prefill")
        for i in range(3):
            tasks.append(asyncio.create_task(edge.post(a, f"a-{i}")))
            await queued_at(edge, a, f"a-{i}", i + 1)
        tasks.append(asyncio.create_task(edge.post(b, "b-0")))
        await queued_at(edge, b, "b-0", 4)
        edge.release.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
    assert [status for status, _, _ in results] == [200] * 5
    assert edge.granted == ["a-holder", "a-0", "a-1", "a-2", "b-0"]
