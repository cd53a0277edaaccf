"""Machines whose wall clocks disagree (docs/control-plane.md, "Clock skew").

A route ask carries its gateway's wall clock (`ts`); a tracker on another machine reads it on
its own. A tracker whose clock ran 10 minutes ahead of the gateway's refused every ask as "too
old" (a 400 blaming the client), though it read each within milliseconds. Only a tracker that
was itself paused for longer than an ask claim lasts judges an ask's age by the stamps.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus import subjects
from bus.server import NatsServer
from schemas.route import RouteDirective, RouteReply, RouteRequest
from tests.fixtures.nats import BusFactory
from tests.test_tracker_group import fake_nodes
from tests.test_tracker_service import CONFIG as SERVICE_CONFIG
from tests.test_tracker_service import WAIT, until
from tracker.asks import ASK_TTL_S, ask_expired, skew_note
from tracker.awake import BACKLOG_S, AwakeClock
from tracker.service import Tracker

ROOT = Path(__file__).resolve().parent.parent
SHIFTED = Path(__file__).resolve().parent / "fixtures" / "shifted_clock"


def start_shifted_tracker(nats: NatsServer, shift_s: float, log: Path) -> subprocess.Popen[bytes]:
    """`meshnet tracker` as its own process, its wall clock `shift_s` seconds off, logging to `log`."""
    user, password = nats.credentials("tracker")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIFTED), str(ROOT)]),
           "MESHNET_TEST_CLOCK_SHIFT": str(shift_s)}
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "meshnet.cli", "tracker", "--tracker-id", "ahead",
                                 "--nats", nats.url, "--nats-user", user, "--nats-password", password,
                                 "--log-level", "info"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)


def ask(sent_at: float) -> RouteRequest:
    return RouteRequest(model="smol", request_id="r1", driver_id="gw-1", ts=sent_at)


@pytest.mark.parametrize(("stamp_age", "unread_max", "expired"), [
    (1.0, BACKLOG_S, False),  # clocks agree, read at once
    (ASK_TTL_S + 1, BACKLOG_S, False),  # tracker 10 min ahead of the gateway: skew, not age
    (-ASK_TTL_S - 1, BACKLOG_S, False),  # tracker 10 min behind
    (ASK_TTL_S + 1, ASK_TTL_S + 5, True),  # just woke from an 10-min pause: it may be that old
    (1.0, ASK_TTL_S + 5, False),  # woke from a pause, but the ask is recent
])
def test_an_ask_is_too_old_only_when_the_tracker_could_have_left_it_unread_that_long(
        stamp_age: float, unread_max: float, expired: bool) -> None:
    now = 1_000_000.0
    assert ask_expired(ask(now - stamp_age), now, unread_max) is expired


def test_skew_beyond_the_ask_ttl_is_named_with_its_size_and_direction() -> None:
    now = 1_000_000.0
    assert skew_note(ask(now - 5), now) is None
    behind = skew_note(ask(now - 700), now)
    assert behind is not None and "700s behind" in behind and "gw-1" in behind and "clock skew" in behind
    ahead = skew_note(ask(now + 700), now)
    assert ahead is not None and "700s ahead of" in ahead


def test_the_awake_clock_bounds_how_long_a_message_can_have_waited_unread() -> None:
    base = [100.0]
    clock = AwakeClock(lambda: base[0], watch_s=0.1)
    clock._read_at = base[0]  # watched
    assert clock.unread_max_s() == BACKLOG_S  # never paused: read within the backlog bound
    base[0] += 700.1  # frozen for 700 s
    clock()
    assert clock.unread_max_s() == pytest.approx(700.0)
    for _ in range(100):  # awake for 10 s, watched every 0.1 s
        base[0] += 0.1
        clock()
    assert clock.unread_max_s() == pytest.approx(710.0)  # still reading what the pause left
    for _ in range(int(BACKLOG_S * 10)):
        base[0] += 0.1
        clock()
    assert clock.unread_max_s() == BACKLOG_S  # long since caught up


async def test_a_tracker_whose_clock_runs_ten_minutes_ahead_still_opens_routes(
        nats_server: NatsServer, bus_factory: BusFactory, tmp_path: Path) -> None:
    """`meshnet tracker` as its own process with its wall clock ASK_TTL_S + 60 s ahead of the
    asker's: it opens the route and logs the skew, naming its size."""
    log = tmp_path / "tracker.log"
    proc = start_shifted_tracker(nats_server, ASK_TTL_S + 60, log)
    try:
        async with fake_nodes(bus_factory, {"h": (0, 15), "t": (15, 30)}):
            gateway = await bus_factory("gateway")
            reply = RouteReply()
            for _ in range(100):  # until the tracker is up and counts both nodes
                req = RouteRequest(model="smol", request_id=f"skew-{_}", driver_id="gw-skew", ts=time.time())
                try:
                    reply = await gateway.request(subjects.ROUTE_CREATE, req, RouteReply, timeout=2.0)
                except Exception:
                    reply = RouteReply()
                if reply.session is not None or (reply.error and reply.error.code != "no_coverage"):
                    break
                await asyncio.sleep(0.2)
            assert reply.error is None, reply.error
            assert reply.session is not None and [h.node_id for h in reply.session.hops] == ["h", "t"]
        text = log.read_text()
        assert "clock skew" in text and "gw-skew" in text and "behind this tracker's wall clock" in text
    finally:
        proc.kill()
        proc.wait()


async def test_a_lost_node_comes_back_when_the_trackers_wall_clock_steps_back(
        bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node reported lost is back at its next two heartbeats, even when the tracker's wall
    clock steps back 10 minutes meanwhile (NTP correcting it, a VM resumed): holds are timed on
    its awake clock. On the wall clock, the node stayed out of routes for those 10 minutes."""
    gateway = await bus_factory("gateway")
    async with fake_nodes(bus_factory, {"head": (0, 15), "tail": (15, 30)}), \
            Tracker(await bus_factory("tracker"), SERVICE_CONFIG) as tracker:
        await until(lambda: {"head", "tail"} <= set(tracker.book.live))
        first = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol", session_id="s1"),
                                      RouteReply, timeout=WAIT)
        assert first.session is not None
        real, suspect = time.time, tracker.book.suspect

        def suspect_then_step_back(node_id: str, at: float):  # type: ignore[no-untyped-def]
            held = suspect(node_id, at)
            monkeypatch.setattr(time, "time", lambda: real() - ASK_TTL_S)  # the machine's clock steps back
            return held

        monkeypatch.setattr(tracker.book, "suspect", suspect_then_step_back)
        await gateway.publish(subjects.route_directive(first.session.route_id), RouteDirective(
            action="abort", session=first.session, issued_by="gateway", reason="hop unreachable",
            lost_node_id="head"))
        await until(lambda: "head" in tracker.book.suspects)
        await until(lambda: "head" not in tracker.book.suspects and "head" in tracker.book.live)
