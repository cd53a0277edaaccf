"""The frame contract: header codec, body codec, credit accounting, admission (pure parts)."""

from __future__ import annotations

import itertools

import numpy as np
import orjson
import pytest

from gateway.route_client import plan_chunks, prefill_chunk_size
from nodes.server.admission import SessionView, check_frame
from schemas.frames import (
    COLOCATED_CHUNK_SIZE,
    DEFAULT_CHUNK_SIZE,
    FrameAck,
    FrameError,
    FrameFormatError,
    FrameHeader,
    FrameResult,
    HopTiming,
    RunEvent,
    ack_bytes,
    choose_compression,
    credit_limit,
    decode_rows,
    encode_rows,
    has_credit,
    max_step_bytes,
    parse_ack,
    parse_ack_wire,
    parse_run_event,
    parse_step_answer,
    parse_step_chunk,
    run_token_bytes,
    split_upstream,
    step_chunk,
    upstream_chunk,
    wire_result,
    wire_timing,
)
from schemas.route import Hop, RouteSession
from wire.client import wire_request_bytes

HIDDEN = 576


def header(**kw: object) -> FrameHeader:
    base: dict[str, object] = dict(session_id="s1", route_id="r1", epoch=1, hop=1, seq=0,
                                   phase="prefill", position=0, n_rows=3, dtype="f32", width=HIDDEN)
    base.update(kw)
    return FrameHeader.model_validate(base)


def test_header_roundtrip_is_compact() -> None:
    h = header(phase="decode", final=True, stream=True, draft=2)
    raw = h.to_header()
    assert FrameHeader.from_header(raw) == h
    assert "compression" not in raw  # defaults are left out
    assert len(header(phase="decode", n_rows=1, final=True).to_header()) < 200


@pytest.mark.parametrize("raw", ["{", '{"session_id": "s"}', header().to_header().replace('"f32"', '"f64"'),
                                 header().to_header()[:-1] + ',"extra":1}'])
def test_bad_header_is_a_format_error(raw: str) -> None:
    with pytest.raises(FrameFormatError):
        FrameHeader.from_header(raw)


@pytest.mark.parametrize("dtype,tol", [("f32", 0.0), ("f16", 1e-3), ("bf16", 8e-3)])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_hidden_rows_roundtrip(dtype: str, tol: float, compression: str) -> None:
    rows = np.random.default_rng(0).standard_normal((5, HIDDEN)).astype(np.float32)
    h = header(n_rows=5, dtype=dtype, compression=compression)
    body = encode_rows(rows, dtype, compression)  # type: ignore[arg-type]
    if compression == "none":
        assert len(body) == h.raw_size
    back = decode_rows(h, body)
    assert back.dtype == np.float32 and back.shape == rows.shape
    np.testing.assert_allclose(back, rows, rtol=tol, atol=tol)


def test_token_ids_roundtrip_and_size_checks() -> None:
    ids = np.array([1, 49151, 7], dtype=np.int32)
    h = header(hop=0, dtype="i32", width=1)
    assert decode_rows(h, encode_rows(ids, "i32")).tolist() == ids.tolist()
    with pytest.raises(FrameFormatError):
        decode_rows(h, encode_rows(ids[:2], "i32"))
    with pytest.raises(FrameFormatError):  # a zstd bomb cannot pass the declared size
        decode_rows(header(n_rows=1, compression="zstd"), encode_rows(np.zeros((9, HIDDEN)), "f32", "zstd"))


@pytest.mark.parametrize("done,window,seq,ok", [
    (0, 4, 0, True), (0, 4, 3, True), (0, 4, 4, False), (5, 2, 6, True), (5, 2, 7, False), (0, 1, 0, True),
])
def test_credit_window(done: int, window: int, seq: int, ok: bool) -> None:
    assert has_credit(seq, credit_limit(done, window)) is ok


def test_compression_negotiation_and_wire_bytes() -> None:
    assert choose_compression("zstd", ["none", "zstd"]) == "zstd"
    assert choose_compression("zstd", ["none"]) == "none"
    n = wire_request_bytes("POST", "/v1/frames", [(b"Host", b"127.0.0.1:1")], 10)
    assert n == len(b"POST /v1/frames HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n") + 10


@pytest.mark.parametrize("n,chunk,expected", [
    (1, 128, [(0, 1)]), (256, 128, [(0, 128), (128, 256)]), (300, 128, [(0, 128), (128, 256), (256, 300)]),
    (129, 128, [(0, 127), (127, 129)]),  # the sampled last token never in a frame of its own
])
def test_plan_chunks(n: int, chunk: int, expected: list[tuple[int, int]]) -> None:
    assert plan_chunks(n, chunk) == expected


@pytest.mark.parametrize("n,chunk,sizes", [
    (512, 64, [16, 32, 60, 60, 60, 59, 59, 59, 59, 32, 16]),
    (173, 64, [16, 32, 39, 38, 32, 16]),
    (100, 64, [64, 36]),  # too short to ramp: plain chunks
    (1, 64, [1]),
])
def test_ramped_chunks_start_and_end_small(n: int, chunk: int, sizes: list[int]) -> None:
    plan = plan_chunks(n, chunk, ramp=True)
    assert [b - a for a, b in plan] == sizes
    assert plan[0][0] == 0 and plan[-1][1] == n and all(a[1] == b[0] for a, b in itertools.pairwise(plan))


VIEW = SessionView(route_id="r1", epoch=1, hop_index=1, next_seq=2, next_position=10, credit=4,
                   decoding=False, running=False, is_head=False, hidden_size=HIDDEN, n_ctx=64)


@pytest.mark.parametrize("change,code", [
    ({}, None),
    ({"route_id": "r2"}, "route_mismatch"),
    ({"epoch": 2}, "epoch_mismatch"),
    ({"hop": 0}, "hop_mismatch"),
    ({"seq": 3}, "seq_mismatch"),
    ({"position": 11}, "position_mismatch"),
    ({"phase": "decode", "n_rows": 1, "final": True}, "phase_mismatch"),
    ({"dtype": "i32", "width": 1}, "bad_frame"),
    ({"width": 7}, "bad_frame"),
    ({"n_rows": 60}, "bad_frame"),  # past n_ctx
])
def test_admission(change: dict[str, object], code: str | None) -> None:
    h = header(**{"seq": 2, "position": 10, **change})
    err = check_frame(VIEW, h)
    assert (err.code if err else None) == code


def test_admission_credit_and_decode_rules() -> None:
    from dataclasses import replace

    assert check_frame(replace(VIEW, credit=2), header(seq=2, position=10)).code == "no_credit"  # type: ignore[union-attr]
    dec = replace(VIEW, decoding=True)
    assert check_frame(dec, header(seq=2, position=10)).code == "phase_mismatch"  # type: ignore[union-attr]
    dec_head = replace(dec, hop_index=0, is_head=True)
    one = {"hop": 0, "seq": 2, "position": 10, "phase": "decode", "dtype": "i32", "width": 1, "final": True}
    assert check_frame(dec_head, header(**{**one, "n_rows": 2})).code == "bad_frame"  # type: ignore[union-attr]
    assert check_frame(dec_head, header(**{**one, "n_rows": 1})) is None  # a Decode Run of one step
    # past the head a decode step is a lane's, never a frame
    assert check_frame(dec, header(seq=2, position=10, phase="decode", n_rows=1, final=True)).code == "bad_frame"  # type: ignore[union-attr]
    head = replace(VIEW, hop_index=0, is_head=True)
    assert check_frame(head, header(hop=0, seq=2, position=10)).code == "bad_frame"  # type: ignore[union-attr]
    assert check_frame(head, header(hop=0, seq=2, position=10, dtype="i32", width=1)) is None


def test_admission_of_decode_runs() -> None:
    from dataclasses import replace

    head = replace(VIEW, hop_index=0, is_head=True, decoding=True)
    run = {"hop": 0, "seq": 2, "position": 10, "dtype": "i32", "width": 1, "phase": "decode",
           "n_rows": 1, "final": True}
    assert check_frame(head, header(**run, steps=54, stop_ids=[2])) is None  # 10 + 54 = n_ctx
    assert check_frame(head, header(**run, steps=55)).code == "bad_frame"  # type: ignore[union-attr]
    tail = replace(VIEW, decoding=True)
    assert check_frame(tail, header(seq=2, position=10, phase="decode", n_rows=1, final=True,
                                    steps=5)).code == "bad_frame"  # type: ignore[union-attr]
    busy = replace(head, running=True)
    assert check_frame(busy, header(**run)).code == "session_busy"  # type: ignore[union-attr]
    with pytest.raises(FrameFormatError):
        FrameHeader.from_header(header(**run).to_header().replace('"final":true', '"final":true,"steps":0'))


def test_admission_of_step_streams() -> None:
    from dataclasses import replace

    tail = replace(VIEW, decoding=True)
    step = {"seq": 2, "position": 10, "phase": "decode", "n_rows": 1, "final": True, "stream": True}
    assert check_frame(tail, header(**step)) is None
    head = replace(tail, hop_index=0, is_head=True)
    assert check_frame(head, header(**{**step, "hop": 0, "dtype": "i32", "width": 1})).code == "bad_frame"  # type: ignore[union-attr]
    assert check_frame(tail, header(**step, steps=3)).code == "bad_frame"  # type: ignore[union-attr]
    assert check_frame(replace(VIEW, decoding=False), header(**{**step, "phase": "prefill"})).code == "bad_frame"  # type: ignore[union-attr]
    assert check_frame(replace(tail, running=True), header(**step)).code == "session_busy"  # type: ignore[union-attr]


def test_admission_of_speculative_streams_and_rewinds() -> None:
    from dataclasses import replace

    tail = replace(VIEW, decoding=True)
    step = {"seq": 2, "position": 10, "phase": "decode", "n_rows": 1, "final": True, "stream": True}
    assert check_frame(tail, header(**step, draft=4)) is None
    # after a verify step at 7 with 2 drafts the session is at 10; the next step may start at 8, 9 or 10
    after = replace(tail, rewind_floor=8)
    for position, code in ((7, "position_mismatch"), (8, None), (9, None), (10, None), (11, "position_mismatch")):
        err = check_frame(after, header(**{**step, "position": position}))
        assert (err.code if err else None) == code, position
    assert check_frame(tail, header(**{**step, "position": 9})).code == "position_mismatch"  # type: ignore[union-attr]
    assert check_frame(replace(VIEW, rewind_floor=8), header(seq=2, position=9)).code == "position_mismatch"  # type: ignore[union-attr]


def test_a_speculative_steps_chunk_carries_its_position_guess_and_drafts() -> None:
    h = header(phase="decode", n_rows=1, final=True, stream=True, draft=4)
    rows = np.random.default_rng(1).standard_normal((3, HIDDEN)).astype(np.float32)
    chunk = step_chunk(17, [5, 6], encode_rows(rows, "f32"))
    position, guess, drafts, got = parse_step_chunk(h, chunk)
    assert (position, guess, drafts) == (17, -1, [5, 6]) and np.array_equal(got, rows)
    assert len(chunk) <= max_step_bytes(h, 0)
    guessed = parse_step_chunk(h, step_chunk(20, [7], encode_rows(rows[:2], "f32"), guess=49151))
    assert guessed[:3] == (20, 49151, [7])
    plain = parse_step_chunk(h, step_chunk(18, [], encode_rows(rows[:1], "f32")))
    assert plain[:3] == (18, -1, []) and plain[3].shape == (1, HIDDEN)
    too_many = step_chunk(17, [1, 2, 3, 4, 5], encode_rows(np.zeros((6, HIDDEN), np.float32), "f32"))
    bad_guess = step_chunk(17, [], encode_rows(rows[:1], "f32"), guess=-2)
    for bad in (too_many, bad_guess, chunk[:5], chunk[:-4], chunk[:13]):
        with pytest.raises(FrameFormatError):
            parse_step_chunk(h, bad)


def test_a_direct_steps_part_carries_the_middle_hops_timings_in_order() -> None:
    rows = encode_rows(np.ones((1, HIDDEN), np.float32), "f32")
    marks = [(1, 6.5, 7.25), (2, 5.0, 5.5)]
    got, rest = split_upstream(upstream_chunk(marks, rows), 3)
    assert got == marks and rest == rows
    assert split_upstream(upstream_chunk([], rows), 1) == ([], rows)  # from the head: none yet
    h = header(hop=3, phase="decode", n_rows=1, final=True, stream=True, direct=True)
    assert len(upstream_chunk(marks, rows)) <= max_step_bytes(h, 0)
    wrong = (upstream_chunk(marks[:1], rows), upstream_chunk(marks[::-1], rows),
             upstream_chunk([(1, 1.0, 1.0), (1, 1.0, 1.0)], rows), upstream_chunk(marks, rows)[:12], b"")
    for bad in wrong:
        with pytest.raises(FrameFormatError):
            split_upstream(bad, 3)


def test_step_answers_parse_to_a_wire_result_or_an_event() -> None:
    result = RESULTS[1]
    assert FrameResult.model_validate(parse_step_answer(run_token_bytes(result))) == result
    end = RunEvent(end=True, credit=9, done=5)
    assert parse_step_answer(end.model_dump_json().encode()) == end
    refused = RunEvent(error=FrameError(code="bad_frame", message="bad chunk"))
    assert parse_step_answer(refused.model_dump_json().encode()) == refused
    for bad in (b"{}x", b'{"result": {"token_id": "7", "position": 1}}', b'{"error": {"code": "nope"}}', b"[1]"):
        with pytest.raises(FrameFormatError):
            parse_step_answer(bad)


RESULTS = [
    FrameResult(token_id=5, position=9),
    FrameResult(token_id=7, position=10, logprob=-0.5, top_logprobs=[(7, -0.5), (3, -2.25)],
                timings=[HopTiming(node_id="a", compute_ms=1.5, handle_ms=2.0),
                         HopTiming(node_id="b", compute_ms=3, handle_ms=4.25)]),
    FrameResult(token_id=9, position=13, drafted=4, accepted=2,  # a verify step's, on its way to the head
                drafts=[FrameResult(token_id=3, position=11), FrameResult(token_id=4, position=12, logprob=-0.25)]),
]


@pytest.mark.parametrize("result", [None, *RESULTS])
def test_the_per_token_codecs_match_the_pydantic_contract(result: FrameResult | None) -> None:
    ack = FrameAck(seq=3, credit=7, done=3, result=result)
    assert FrameAck.model_validate_json(ack_bytes(3, 7, 3, result)) == ack  # what pydantic reads back
    assert parse_ack(ack.model_dump_json().encode()) == ack
    assert parse_ack(ack_bytes(3, 7, 3, result)) == ack
    if result is not None:
        event = RunEvent(result=result)
        assert RunEvent.model_validate_json(run_token_bytes(result)) == event
        assert parse_run_event(run_token_bytes(result)) == event
        # the same result as its JSON object (the nodes' per-token path) encodes the same JSON
        wire = result.model_dump(exclude_defaults=True)
        assert orjson.loads(ack_bytes(3, 7, 3, wire)) == orjson.loads(ack_bytes(3, 7, 3, result))
        assert orjson.loads(run_token_bytes(wire)) == orjson.loads(run_token_bytes(result))
        credit, parsed, accepted = parse_ack_wire(ack_bytes(3, 7, 3, result))
        assert (credit, accepted) == (7, ["none", "zstd"])
        assert FrameResult.model_validate(parsed) == result


def test_a_tails_wire_result_is_a_frame_result() -> None:
    t = wire_timing("tail", 7.5, 8.0)
    assert FrameResult.model_validate(wire_result(11, 40, t)) == FrameResult(
        token_id=11, position=40, timings=[HopTiming(node_id="tail", compute_ms=7.5, handle_ms=8.0)])
    full = wire_result(11, 40, t, -0.25, [(11, -0.25), (2, -3.0)])
    assert FrameResult.model_validate_json(run_token_bytes(full).removeprefix(b'{"result":')[:-1]) == FrameResult(
        token_id=11, position=40, logprob=-0.25, top_logprobs=[(11, -0.25), (2, -3.0)],
        timings=[HopTiming(node_id="tail", compute_ms=7.5, handle_ms=8.0)])


@pytest.mark.parametrize("raw", [
    b"not json", b"[]", b'{"seq": 1, "credit": 2}', b'{"seq": "1", "credit": 2, "done": 1}',
    b'{"seq": 1, "credit": 2, "done": 1, "result": {"token_id": 1.5, "position": 3}}',
    b'{"seq": 1, "credit": 2, "done": 1, "result": {"token_id": 1, "position": 3, "timings": [{}]}}',
])
def test_a_bad_ack_is_a_format_error(raw: bytes) -> None:
    with pytest.raises(FrameFormatError):
        parse_ack(raw)
    if b"timings" not in raw:  # the per-token path checks what it uses: ids, positions, credit
        with pytest.raises(FrameFormatError):
            parse_ack_wire(raw)


def test_run_events_parse_on_both_paths() -> None:
    end = RunEvent(end=True, credit=9, done=5)
    assert parse_run_event(end.model_dump_json().encode()) == end
    for bad in (b"{}x", b'{"result": {"token_id": "7", "position": 1}}', b'{"end": "maybe"}', b"[1]"):
        with pytest.raises(FrameFormatError):
            parse_run_event(bad)


def test_headers_round_trip_without_their_defaults() -> None:
    h = header(steps=4, stop_ids=[2, 0], final=True, draft=4)
    assert FrameHeader.from_header(h.to_header()) == h
    assert orjson.loads(h.to_header()) == h.model_dump(exclude_defaults=True)
    plain = header()
    assert orjson.loads(plain.to_header()) == plain.model_dump(exclude_defaults=True)
    assert "steps" not in plain.to_header() and "compression" not in plain.to_header()


def _route(*urls: str) -> RouteSession:
    hops = [Hop(node_id=f"n{i}", activation_url=u, layer_start=i, layer_end=i + 1) for i, u in enumerate(urls)]
    return RouteSession(session_id="s", route_id="r", model="m", model_revision="m", cache_abi="a",
                        n_layer=len(urls), hidden_size=HIDDEN, n_ctx=64, hops=hops)


@pytest.mark.parametrize("urls,chunk", [
    (("http://127.0.0.1:7001", "http://127.0.0.1:7002"), COLOCATED_CHUNK_SIZE),
    (("http://localhost:7001", "http://[::1]:7002", "http://127.0.0.2:1"), COLOCATED_CHUNK_SIZE),
    (("http://127.0.0.1:7001", "http://10.0.0.7:7002"), DEFAULT_CHUNK_SIZE),  # another machine
    (("http://node-a:7001", "http://node-b:7002"), DEFAULT_CHUNK_SIZE),
    (("http://127.0.0.1:7001",), DEFAULT_CHUNK_SIZE),  # one hop: nothing to pipeline or to share
])
def test_prefill_chunks_are_large_only_when_every_hop_shares_this_machine(urls: tuple[str, ...], chunk: int) -> None:
    assert prefill_chunk_size(_route(*urls)) == chunk
