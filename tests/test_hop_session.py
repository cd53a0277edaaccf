"""HopSession on the tail: a decode step goes to the hop scheduler from the callback that
admitted it when the worker has nothing in hand, and is answered from the scheduler's next
iteration without the worker; a failure there ends the session as any other does. On
the head: a Decode Run hands each token to its caller once the next step's row has left, and
every token the tail answered reaches the caller before a failure.

The engines are scripted (the tests are about who runs the step and who answers; the real
engine runs through the same path in the route tests)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from nodes.engine import BatchPart, EngineError, ShardOutput, TokenChoice
from nodes.server.hop_machine import HopPhase, PromptIn
from nodes.server.runner import EngineRunner
from nodes.server.scheduler import HopScheduler
from nodes.server.session import HopConfig, HopSession
from schemas.frames import FrameHeader, FrameResult, RunEvent
from schemas.route import Hop, RouteFailure, RouteSession
from tests.test_seam_link import LinkServer

WIDTH = 4


class ScriptedEngine:
    """forward_batch over a scripted per-part forward (a part's EngineError is its result)."""

    def forward(self, session_id: str, position: int, *, token_ids=None, hidden=None) -> ShardOutput:
        raise NotImplementedError

    def capability(self) -> SimpleNamespace:
        return SimpleNamespace(prefill_tokens_per_second=0.0)

    def forward_batch(self, parts: list[BatchPart]) -> list[object]:
        out: list[object] = []
        for p in parts:
            ids, hidden = (p.rows, None) if p.rows.dtype == np.int32 else (None, p.rows)
            try:
                out.append(self.forward(p.session_id, p.position, token_ids=ids, hidden=hidden))
            except EngineError as exc:
                out.append(exc)
        return out


def config(node_id: str, engine: ScriptedEngine) -> HopConfig:
    runner = EngineRunner(engine, None)  # type: ignore[arg-type]
    return HopConfig(node_id=node_id, runner=runner, scheduler=HopScheduler(runner), hidden_size=WIDTH,
                     n_ctx=64, window=4)


class ScriptedTail(ScriptedEngine):
    """A tail engine that answers token 7, or raises when told to."""

    def __init__(self) -> None:
        self.fail = False
        self.calls = 0
        self.inputs: list[str] = []

    def forward(self, session_id: str, position: int, *, token_ids=None, hidden=None) -> ShardOutput:
        self.calls += 1
        self.inputs.append("ids" if token_ids is not None and hidden is None else "hidden")
        if self.fail:
            raise EngineError("scripted failure")
        return ShardOutput(token=TokenChoice(token_id=7))

    def cache_bytes(self, session_id: str) -> int:
        return 0


def tail_session(engine: ScriptedTail, failed: list[HopSession], n_hops: int = 2) -> HopSession:
    hops = [Hop(node_id="head", activation_url="http://127.0.0.1:1", layer_start=0, layer_end=1),
            Hop(node_id="tail", activation_url="http://127.0.0.1:2", layer_start=1, layer_end=2)][-n_hops:]
    route = RouteSession(session_id="s", route_id="r", model="m", model_revision="m", cache_abi="a",
                         n_layer=2, hidden_size=WIDTH, n_ctx=64, hops=hops)
    cfg = config("tail", engine)

    async def on_failed(hs: HopSession, failure: RouteFailure) -> None:
        failed.append(hs)
        hs.end(HopPhase.FAILED, "scripted", failure)
        await hs.stop()

    hs = HopSession(route, n_hops - 1, cfg, on_failed)
    hs.next_seq = hs.done = 3
    hs.next_position = hs.done_position = 10
    hs.apply(PromptIn())
    hs.start()
    return hs


def decode_frame(seq: int, position: int, hop: int = 1) -> FrameHeader:
    """A decode step: past the head a lane's (stream), into the head a Decode Run's frame."""
    return FrameHeader(session_id="s", route_id="r", epoch=1, hop=hop, seq=seq, phase="decode",
                       position=position, n_rows=1, dtype="f32" if hop else "i32",
                       width=WIDTH if hop else 1, final=True, stream=hop > 0)


async def one_loop_round() -> None:
    await asyncio.sleep(0)  # the scheduler's iteration runs as the next ready callback


async def test_a_decode_step_on_an_idle_tail_is_answered_from_the_schedulers_iteration() -> None:
    engine, failed = ScriptedTail(), []
    hs = tail_session(engine, failed)
    answers: list[object] = []
    hs.accept(decode_frame(3, 10), np.zeros((1, WIDTH), np.float32), 100, 16, reply=answers.append)
    assert answers == [] and hs.inbox.empty()  # handed to the scheduler, not to the worker
    await one_loop_round()
    assert len(answers) == 1 and isinstance(answers[0], dict)
    assert answers[0]["token_id"] == 7 and answers[0]["position"] == 11
    assert [t["node_id"] for t in answers[0]["timings"]] == ["tail"]
    assert (hs.done, hs.done_position, hs.counters.buffered, hs.counters.decode_tokens) == (4, 11, 0, 1)
    hs.accept(decode_frame(4, 11), np.zeros((1, WIDTH), np.float32), 100, 16, reply=answers.append)
    await one_loop_round()
    assert len(answers) == 2 and engine.inputs == ["hidden", "hidden"] and not failed
    await hs.stop()


async def test_a_one_hop_routes_tail_runs_its_token_ids_in_a_decode_run() -> None:
    engine, failed = ScriptedTail(), []
    hs = tail_session(engine, failed, n_hops=1)  # the head is the tail
    answers: list[object] = []
    tokens: list[dict] = []

    def emit(result: dict) -> bool:
        tokens.append(result)
        return True

    hs.accept(decode_frame(3, 10, hop=0), np.array([5], np.int32), 100, 4, reply=answers.append, emit=emit)
    for _ in range(100):
        if answers:
            break
        await asyncio.sleep(0.01)
    assert [t["token_id"] for t in tokens] == [7] and len(answers) == 1  # one step, then the run's end
    assert engine.inputs == ["ids"] and not failed
    await hs.stop()


async def test_a_failing_step_run_at_once_fails_the_session_through_the_worker() -> None:
    engine, failed = ScriptedTail(), []
    hs = tail_session(engine, failed)
    engine.fail = True
    answers: list[object] = []
    hs.accept(decode_frame(3, 10), np.zeros((1, WIDTH), np.float32), 100, 16, reply=answers.append)
    assert answers == []  # the worker takes the failure over
    for _ in range(100):
        if answers:
            break
        await asyncio.sleep(0.01)
    assert failed == [hs] and hs.life.phase is HopPhase.FAILED
    assert len(answers) == 1 and isinstance(answers[0], RouteFailure)
    assert answers[0].hop_index == 1 and "scripted failure" in answers[0].reason


class ScriptedHead(ScriptedEngine):
    """A head engine that returns one hidden row per call and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, session_id: str, position: int, *, token_ids=None, hidden=None) -> ShardOutput:
        self.calls += 1
        return ShardOutput(hidden=np.ones((1, WIDTH), np.float32))

    def cache_bytes(self, session_id: str) -> int:
        return 0


async def run_on_a_head(events: list[bytes], steps: int) -> tuple[ScriptedHead, list[tuple[int, int]], list[object]]:
    """A 2-hop route's head with a scripted tail (LinkServer): one Decode Run of `steps` from
    position 10; returns the engine, (token, head calls so far) per streamed token, and the reply."""
    engine, emitted, replies = ScriptedHead(), [], []
    async with LinkServer({"s": events}) as url:
        hops = [Hop(node_id="head", activation_url="http://127.0.0.1:1", layer_start=0, layer_end=1),
                Hop(node_id="tail", activation_url=url, layer_start=1, layer_end=2)]
        route = RouteSession(session_id="s", route_id="r", model="m", model_revision="m", cache_abi="a",
                             n_layer=2, hidden_size=WIDTH, n_ctx=64, hops=hops)
        cfg = config("head", engine)

        async def on_failed(hs: HopSession, failure: RouteFailure) -> None:
            hs.end(HopPhase.FAILED, "scripted", failure)
            await hs.stop()

        hs = HopSession(route, 0, cfg, on_failed)
        hs.next_position = hs.done_position = 10  # seq 0: within the link's first credit
        hs.apply(PromptIn())
        hs.start()

        def emit(result: dict) -> bool:
            emitted.append((result["token_id"], engine.calls))
            return True

        header = FrameHeader(session_id="s", route_id="r", epoch=1, hop=0, seq=0, phase="decode", position=10,
                             n_rows=1, dtype="i32", width=1, final=True, steps=steps)
        hs.accept(header, np.array([5], np.int32), 100, 4, reply=replies.append, emit=emit)
        for _ in range(500):
            if replies:
                break
            await asyncio.sleep(0.01)
        await hs.stop()
    return engine, emitted, replies


def result_event(token_id: int, position: int) -> bytes:
    return RunEvent(result=FrameResult(token_id=token_id, position=position)).model_dump_json().encode()


async def test_a_runs_token_goes_to_the_caller_once_the_next_steps_row_has_left() -> None:
    engine, emitted, replies = await run_on_a_head([result_event(20 + i, 11 + i) for i in range(4)], steps=4)
    assert engine.calls == 4
    # token i is handed on after the head's call for step i+1 (and that row's send); the last at once
    assert emitted == [(20, 2), (21, 3), (22, 4), (23, 4)]
    assert len(replies) == 1 and isinstance(replies[0], dict) and replies[0]["token_id"] == 23


async def test_every_token_the_tail_answered_reaches_the_caller_before_the_failure() -> None:
    failure = RouteFailure(session_id="s", route_id="r", phase="decode", hop_index=1, node_id="tail",
                           reason="scripted tail failure")
    events = [result_event(20, 11), result_event(21, 12), result_event(22, 13),
              RunEvent(failure=failure).model_dump_json().encode()]
    engine, emitted, replies = await run_on_a_head(events, steps=50)
    assert [t for t, _ in emitted] == [20, 21, 22] and engine.calls == 4
    assert len(replies) == 1 and isinstance(replies[0], RouteFailure)
    assert "scripted tail failure" in replies[0].reason
