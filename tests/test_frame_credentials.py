"""Session-scoped frame credentials against real node processes, turned from the probe's
findings: an outsider cannot abort a stream, race the rightful head at open, forge a frame
from anything a monitor sees on `mesh.>`, or list a node's sessions with their token counts;
the live session is untouched and its greedy tokens equal the single-process answer."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import orjson

from bus import subjects
from gateway.route_client import RouteClient
from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import SESSIONS_PATH, FrameHeader, encode_rows
from schemas.route import RouteDirective
from tests.fixtures.mesh import OPERATOR, Mesh, NodeProc
from tests.test_route_exact import reference_greedy
from tests.test_route_wire import post

HEX32 = re.compile(r"\b[0-9a-f]{32}\b")
N = 12


async def post_frame(mesh: Mesh, node: NodeProc, header: FrameHeader, body: bytes,
                     credential: str | None) -> tuple[int, str]:
    status, err = await post(mesh, node, header, body, credential)
    return status, err["code"]


async def test_outsiders_cannot_abort_race_or_forge_a_frame(mesh: Mesh, bus_factory, model_path) -> None:
    head, tail = await mesh.spawn((0, 15)), await mesh.spawn((15, 30))
    monitor = await bus_factory("monitor", name="probe")
    seen: list[bytes] = []  # every message the monitor role can read during the chat
    prompt = list(range(300, 316))
    forged: list[tuple[int, str]] = []

    async def keep(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(msg.data)  # raw: whatever the monitor role receives, parsed or not

    watcher = await monitor._nc.subscribe(subjects.ALL, cb=keep)

    async def race() -> None:
        """Post a seq-0 prefill frame to the head the moment its open directive appears."""
        async with monitor.subscribe(subjects.DIRECTIVE_ALL, RouteDirective) as sub:
            async for d in sub:
                if d.action != "open":
                    continue
                s = d.session
                h = FrameHeader(session_id=s.session_id, route_id=s.route_id, epoch=s.epoch, hop=0, seq=0,
                                phase="prefill", position=0, n_rows=4, dtype="i32", width=1, final=True)
                body = encode_rows(np.array([1, 2, 3, 4], np.int32), "i32")
                for cred in (None, *HEX32.findall(d.to_json().decode())):
                    forged.append(await post_frame(mesh, head, h, body, cred))
                return

    racer = asyncio.create_task(race())
    await monitor.flush()
    session = await mesh.route([head, tail], prompt_tokens=len(prompt))
    await asyncio.wait_for(racer, 10)
    assert forged and all(f == (401, "bad_credential") for f in forged), forged

    async with RouteClient(session, mesh.http, chunk_size=8, bus=mesh.bus) as rc:
        first = await rc.prefill(prompt)
        tokens = [first.token_id]
        for _ in range(N // 2):
            tokens.append((await rc.decode(tokens[-1])).token_id)

        # the anonymous abort: refused, and its reason reaches nobody
        url = f"{tail.url}{SESSIONS_PATH}/{session.session_id}"
        for headers in ({}, {CREDENTIAL_HEADER: session.credentials[0]}):  # none, or the head's
            async with mesh.http.delete(url, params={"action": "abort", "reason": "pwned"}, headers=headers) as r:
                assert r.status == 401 and (await r.json())["code"] == "bad_credential"

        # the listings show nothing that lets an outsider in, even to the node's operator
        for node in (head, tail):
            async with mesh.http.get(f"{node.url}{SESSIONS_PATH}", headers=OPERATOR) as r:
                listing = await r.text()
            assert session.session_id in listing and not any(c in listing for c in session.credentials)

        # an anonymous caller sees only totals: no session ids, no per-session token counts
        for node in (head, tail):
            async with mesh.http.get(f"{node.url}{SESSIONS_PATH}") as r:
                totals = await r.json()
            assert totals["live_sessions"] == 1 and totals["engine_sessions"] == 1 and totals["cache_bytes"] > 0
            assert "sessions" not in totals and "parked" not in totals
            assert session.session_id not in orjson.dumps(totals).decode()
        # one session's counters: to its hop credential (the route's driver) or the operator only
        for headers, status in (({}, 401), ({CREDENTIAL_HEADER: session.credentials[0]}, 401),
                                ({"Authorization": "Bearer guess"}, 401), ({CREDENTIAL_HEADER: session.credentials[1]}, 200),
                                (OPERATOR, 200)):
            async with mesh.http.get(url, headers=headers) as r:
                assert r.status == status, (headers, await r.text())
                if status == 200:
                    assert (await r.json())["prefill_tokens"] == len(prompt)
        async with mesh.http.get(f"{tail.url}{SESSIONS_PATH}/no-such-session") as r:
            assert r.status == 401  # the same answer as for a live session: nothing learnt

        # everything a monitor saw: no credential in clear, and no string in it opens a hop
        everything = b"\n".join(seen).decode()
        assert everything and not any(c in everything for c in session.credentials)
        candidates = set(HEX32.findall(everything))
        assert candidates  # the sealed next-hop credential of the head, at least
        row = encode_rows(np.ones((1, 576), np.float32), "f32")
        for cred in candidates:
            h = FrameHeader(session_id=session.session_id, route_id=session.route_id, epoch=session.epoch,
                            hop=1, seq=rc.seq, phase="decode", position=rc.position, n_rows=1,
                            dtype="f32", width=576, final=True)
            assert await post_frame(mesh, tail, h, row, cred) == (401, "bad_credential")

        while len(tokens) < N:
            tokens.append((await rc.decode(tokens[-1])).token_id)
    await watcher.unsubscribe()
    assert tokens == reference_greedy(model_path, prompt, N)  # the live session was never touched
    stats = await mesh.session_stats(tail, session.session_id)
    assert stats["state"] == "closed"  # closed by its owner, not aborted by the probe
