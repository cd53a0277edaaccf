"""HopSession on the tail: a decode step runs at once in the callback that admitted it when
the worker has nothing in hand, and a failure there ends the session as any other does.

The engine is scripted (the test is about who runs the step and who answers; the real engine
runs through the same path in the route tests)."""

from __future__ import annotations

import asyncio

import numpy as np

from nodes.engine import EngineError, ShardOutput, TokenChoice
from nodes.server.runner import EngineRunner
from nodes.server.session import HopConfig, HopSession
from schemas.frames import FrameHeader
from schemas.route import Hop, RouteFailure, RouteSession

WIDTH = 4


class ScriptedTail:
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
    cfg = HopConfig(node_id="tail", runner=EngineRunner(engine, None), hidden_size=WIDTH, n_ctx=64, window=4)

    async def on_failed(hs: HopSession) -> None:
        failed.append(hs)
        hs.mark_ended("failed", "scripted", hs.failure)
        await hs.stop()

    hs = HopSession(route, n_hops - 1, cfg, on_failed)
    hs.next_seq = hs.done = 3
    hs.next_position = hs.done_position = 10
    hs.decoding = True
    hs.start()
    return hs


def decode_frame(seq: int, position: int, hop: int = 1) -> FrameHeader:
    return FrameHeader(session_id="s", route_id="r", epoch=1, hop=hop, seq=seq, phase="decode",
                       position=position, n_rows=1, dtype="f32" if hop else "i32",
                       width=WIDTH if hop else 1, final=True)


async def test_a_decode_step_on_an_idle_tail_is_answered_before_accept_returns() -> None:
    engine, failed = ScriptedTail(), []
    hs = tail_session(engine, failed)
    answers: list[object] = []
    hs.accept(decode_frame(3, 10), np.zeros((1, WIDTH), np.float32), 100, 16, reply=answers.append)
    assert len(answers) == 1 and isinstance(answers[0], dict)  # no await in between: the worker never woke
    assert answers[0]["token_id"] == 7 and answers[0]["position"] == 11
    assert [t["node_id"] for t in answers[0]["timings"]] == ["tail"]
    assert (hs.done, hs.done_position, hs.counters.buffered, hs.counters.decode_tokens) == (4, 11, 0, 1)
    hs.accept(decode_frame(4, 11), np.zeros((1, WIDTH), np.float32), 100, 16, reply=answers.append)
    assert len(answers) == 2 and engine.inputs == ["hidden", "hidden"] and not failed
    await hs.stop()


async def test_a_one_hop_routes_tail_runs_its_token_ids_at_once() -> None:
    engine, failed = ScriptedTail(), []
    hs = tail_session(engine, failed, n_hops=1)  # the head is the tail
    answers: list[object] = []
    hs.accept(decode_frame(3, 10, hop=0), np.array([5], np.int32), 100, 4, reply=answers.append)
    assert len(answers) == 1 and isinstance(answers[0], dict) and answers[0]["token_id"] == 7
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
    assert failed == [hs] and hs.state == "failed"
    assert len(answers) == 1 and isinstance(answers[0], RouteFailure)
    assert answers[0].hop_index == 1 and "scripted failure" in answers[0].reason
