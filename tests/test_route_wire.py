"""What crosses a seam: O(hidden) decode frames, and typed 4xx refusals before any execution."""

from __future__ import annotations

import aiohttp
import numpy as np
import orjson

from gateway.route_client import RouteClient
from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import FRAME_HEADER, FRAMES_PATH, FrameHeader, encode_rows
from tests.fixtures.mesh import Mesh, NodeProc

HIDDEN = 576
HEADER_BUDGET = 512  # bytes per frame for the request line and all HTTP headers (documented)


def random_prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, size=n).tolist()


async def decode_bytes(mesh: Mesh, head: NodeProc, tail: NodeProc, n_prompt: int, steps: int) -> tuple[dict, dict]:
    session = await mesh.route([head, tail], prompt_tokens=n_prompt)
    async with RouteClient(session, mesh.http, chunk_size=256, bus=mesh.bus) as rc:
        tok = (await rc.prefill(random_prompt(n_prompt, n_prompt))).token_id
        before = await mesh.session_stats(tail, session.session_id)
        for _ in range(steps):
            tok = (await rc.decode(tok)).token_id
        after = await mesh.session_stats(tail, session.session_id)
        head_stats = await mesh.session_stats(head, session.session_id)
    assert after["decode_frames"] - before["decode_frames"] == steps
    seam = {k: after[k] - before[k] for k in ("decode_rx_bytes", "rx_body_bytes")}
    return seam, head_stats


async def test_decode_seam_bytes_are_one_row_whatever_the_context(mesh: Mesh) -> None:
    head, tail = await mesh.spawn((0, 15)), await mesh.spawn((15, 30))
    steps = 100
    short, _head_short = await decode_bytes(mesh, head, tail, 100, steps)
    long, head_long = await decode_bytes(mesh, head, tail, 2000, steps)
    for seam in (short, long):
        assert seam["rx_body_bytes"] == steps * HIDDEN * 4  # exactly one f32 row per step
        assert seam["decode_rx_bytes"] / steps <= HIDDEN * 4 + HEADER_BUDGET
    print(f"\nseam bytes per decode step: {short['decode_rx_bytes'] / steps:.1f} after 100 positions, "
          f"{long['decode_rx_bytes'] / steps:.1f} after 2000 (body {HIDDEN * 4})")
    # header digits (position, seq) may grow by a few bytes; the payload does not grow with context
    assert abs(long["decode_rx_bytes"] - short["decode_rx_bytes"]) / steps <= 8
    # the head received the prompt once (as token ids) and one token id per decode step
    assert head_long["prefill_tokens"] == 2000 and head_long["decode_tokens"] == steps
    assert head_long["rx_body_bytes"] == (2000 + steps) * 4


async def post(mesh: Mesh, node: NodeProc, header: FrameHeader, body: bytes,
               credential: str | None) -> tuple[int, dict]:
    headers = {FRAME_HEADER: header.to_header(), "content-type": "application/octet-stream"}
    if credential is not None:
        headers[CREDENTIAL_HEADER] = credential
    # a connection of its own: one that served the node's app (a listing) carries no frames
    async with aiohttp.ClientSession() as http, http.post(node.url + FRAMES_PATH, data=body, headers=headers) as resp:
        return resp.status, orjson.loads(await resp.read())


async def test_mismatched_frames_get_typed_4xx_before_execution(mesh: Mesh) -> None:
    head, tail = await mesh.spawn((0, 15)), await mesh.spawn((15, 30))
    session = await mesh.route([head, tail])
    other = await mesh.route([head, tail])  # another session on the same hops
    async with RouteClient(session, mesh.http, chunk_size=8, bus=mesh.bus) as rc:
        first = await rc.prefill(random_prompt(10, 1))
        cred = session.credentials[1]  # the tail's
        # without the tail's credential for this session, nothing else is even looked at
        for wrong in (None, "", session.credentials[0], other.credentials[1], "0" * 32, "x" * 300):
            status, err = await post(mesh, tail, FrameHeader(
                session_id=session.session_id, route_id=session.route_id, epoch=session.epoch, hop=1,
                seq=rc.seq, phase="decode", position=rc.position, n_rows=1, dtype="f32", width=HIDDEN,
                final=True), encode_rows(np.ones((1, HIDDEN), np.float32), "f32"), wrong)
            assert (status, err["code"]) == (401, "bad_credential"), wrong
        good = FrameHeader(session_id=session.session_id, route_id=session.route_id, epoch=session.epoch,
                           hop=1, seq=rc.seq, phase="decode", position=rc.position, n_rows=1,
                           dtype="f32", width=HIDDEN, final=True)
        row = encode_rows(np.ones((1, HIDDEN), np.float32), "f32")
        cases = [
            ({"session_id": "nope"}, row, 404, "unknown_session"),
            ({"route_id": "other"}, row, 409, "route_mismatch"),
            ({"epoch": session.epoch + 1}, row, 409, "epoch_mismatch"),
            ({"position": rc.position + 1}, row, 409, "position_mismatch"),
            ({"position": rc.position - 1}, row, 409, "position_mismatch"),
            ({"seq": rc.seq + 1}, row, 409, "seq_mismatch"),
            ({"hop": 0}, row, 409, "hop_mismatch"),
            ({"phase": "prefill"}, row, 409, "phase_mismatch"),
            ({"width": 7}, row, 400, "bad_frame"),
            ({}, row[:-4], 400, "bad_frame"),
        ]
        for change, body, status, code in cases:
            got_status, err = await post(mesh, tail, good.model_copy(update=change), body, cred)
            assert (got_status, err["code"]) == (status, code), change
            stats = await mesh.session_stats(tail, session.session_id)
            assert stats["engine_position"] == 10 and stats["frames"] == 2, change  # nothing ran
        # a token-id frame sent to the head with the wrong position is refused the same way
        tok = good.model_copy(update={"hop": 0, "dtype": "i32", "width": 1, "position": 3})
        status, err = await post(mesh, head, tok, encode_rows(np.array([5]), "i32"), session.credentials[0])
        assert (status, err["code"]) == (409, "position_mismatch")
        assert (await mesh.session_stats(head, session.session_id))["engine_position"] == 10
        # the session is intact: the route continues exactly where it was
        nxt = await rc.decode(first.token_id)
        assert nxt.position == 11
    status, err = await post(mesh, tail, good.model_copy(update={"seq": 3, "position": 11}), row, cred)
    assert (status, err["code"]) == (410, "session_closed")
