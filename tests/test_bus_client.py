"""Bus over a real nats-server: pub/sub, skipping bad messages, request/serve, typed errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

import pytest

from bus import subjects
from bus.client import Bus, _connect_callbacks
from bus.errors import BusConnectError, BusNoRespondersError, BusTimeoutError
from bus.port_probe import scheme_problem, speaks_http
from bus.server import NatsServer
from schemas.base import SchemaError
from schemas.node import NodeHeartbeat
from schemas.route import RouteError, RouteReply, RouteRequest
from schemas.tracker import TrackerHello
from tests.fixtures.nats import BusFactory

WAIT = 30.0  # only a guard against hanging; nothing asserts on time


async def _raw_publish(bus: Bus, subject: str, payload: bytes) -> None:
    await bus._nc.publish(subject, payload)


async def test_publish_subscribe_roundtrip_with_subject(bus_factory: BusFactory) -> None:
    tracker = await bus_factory("tracker")
    node = await bus_factory("node", name="n1")
    async with tracker.subscribe(subjects.HEARTBEAT_ALL, NodeHeartbeat) as sub:
        await tracker.flush()
        sent = NodeHeartbeat(node_id="n1", load=0.25, sessions=2, free_session_slots=3)
        await node.publish(subjects.node_heartbeat("n1"), sent)
        pairs = sub.with_subjects()
        subject, got = await asyncio.wait_for(anext(pairs), WAIT)
    assert subject == "mesh.node.n1.heartbeat"
    assert sub.last_subject == subject
    assert got == sent


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b"{not json", "malformed"),
        (b"[1, 2]", "malformed"),
        (b'{"v": 99, "node_id": "n1"}', "unknown_version"),
        (b'{"v": 1, "node_id": "n1", "load": -3}', "invalid"),
        (b'{"v": 1}', "invalid"),
    ],
)
async def test_bad_messages_are_skipped_and_subscriber_survives(
    bus_factory: BusFactory, payload: bytes, kind: str
) -> None:
    tracker = await bus_factory("tracker")
    node = await bus_factory("node", name="n1")
    async with tracker.subscribe(subjects.HEARTBEAT_ALL, NodeHeartbeat) as sub:
        await tracker.flush()
        await _raw_publish(node, subjects.node_heartbeat("n1"), payload)
        await node.publish(subjects.node_heartbeat("n1"), NodeHeartbeat(node_id="n1", sessions=7))
        got = await sub.next(WAIT)
    assert got.sessions == 7
    assert sub.n_schema_errors == 1
    err = sub.schema_errors[0]
    assert isinstance(err, SchemaError)
    assert err.kind == kind
    assert err.subject == "mesh.node.n1.heartbeat"


async def test_request_serve_and_typed_errors(bus_factory: BusFactory) -> None:
    tracker = await bus_factory("tracker")
    gateway = await bus_factory("gateway")

    with pytest.raises(BusNoRespondersError) as no_one:
        await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="m"), RouteReply, timeout=5)
    assert no_one.value.subject == subjects.ROUTE_CREATE

    seen: list[str] = []

    async def handler(req: RouteRequest) -> RouteReply:
        seen.append(req.model)
        if req.model == "boom":
            raise RuntimeError("handler exploded")
        return RouteReply(error=RouteError(code="unknown_model", message=req.model))

    responder = await tracker.serve(
        subjects.ROUTE_CREATE,
        RouteRequest,
        handler,
        on_error=lambda exc: RouteReply(error=RouteError(code="bad_request", message=str(exc))),
    )
    await tracker.flush()
    reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="m1"), RouteReply, timeout=WAIT)
    assert reply.error is not None and reply.error.message == "m1"
    reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="boom"), RouteReply, timeout=WAIT)
    assert reply.error is not None and reply.error.code == "bad_request"
    raw = await gateway._nc.request(subjects.ROUTE_CREATE, b'{"v": 1}', timeout=WAIT)
    bad = RouteReply.from_json(raw.data)
    assert bad.error is not None and bad.error.code == "bad_request"
    assert seen == ["m1", "boom"]  # the malformed request never reached the handler

    # a responder that never answers -> typed timeout
    await responder.stop()
    async with tracker.subscribe(subjects.ROUTE_CREATE, RouteRequest):  # swallows requests
        await tracker.flush()
        with pytest.raises(BusTimeoutError) as timed_out:
            await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="m"), RouteReply, timeout=0.2)
    assert not isinstance(timed_out.value, BusNoRespondersError)
    assert timed_out.value.timeout == 0.2


async def test_subscriptions_and_responders_live_through_a_server_restart(
    nats_server: NatsServer, bus_factory: BusFactory
) -> None:
    tracker = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    node = await bus_factory("node", name="n1")

    def answer(req: RouteRequest) -> RouteReply:
        return RouteReply(error=RouteError(code="unknown_model", message=req.model))

    await tracker.serve(subjects.ROUTE_CREATE, RouteRequest, answer)
    async with tracker.subscribe(subjects.HEARTBEAT_ALL, NodeHeartbeat) as sub:
        await tracker.flush()
        await nats_server.restart()  # same port, same store; every client reconnects by itself
        for _ in range(int(WAIT / 0.02)):
            if all(b.is_connected and b.reconnects == 1 for b in (tracker, gateway, node)):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the clients did not reconnect after the restart")
        await node.publish(subjects.node_heartbeat("n1"), NodeHeartbeat(node_id="n1", sessions=5))
        got = await sub.next(WAIT)  # the subscription was replayed on the new connection
        reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="m"), RouteReply, timeout=WAIT)
    assert got.sessions == 5
    assert reply.error is not None and reply.error.message == "m"  # and so was the responder


def test_bus_settings_resolution_order() -> None:
    from bus.config import BusSettings, UnknownRoleError

    dev = BusSettings.resolve("gateway", env={})
    assert (dev.url, dev.user, dev.password) == ("nats://127.0.0.1:4222", "gateway", "gateway-dev")
    env = {"MESHNET_NATS_URL": "nats://e:1", "MESHNET_NATS_USER": "eu", "MESHNET_NATS_PASSWORD": "ep"}
    from_env = BusSettings.resolve("node", env=env)
    assert (from_env.url, from_env.user, from_env.password) == ("nats://e:1", "eu", "ep")
    flags = BusSettings.resolve("node", url="nats://f:2", user="fu", password="fp", env=env)
    assert (flags.url, flags.user, flags.password) == ("nats://f:2", "fu", "fp")
    with pytest.raises(UnknownRoleError):
        BusSettings.resolve("admin", env={})


async def test_a_flush_that_times_out_across_a_partition_leaves_the_connection_working(
        nats_server: NatsServer, bus_factory: BusFactory) -> None:
    """nats-py's own flush cancels its PONG future on a timeout, and the PONG that comes when
    the partition heals then ends the client's read loop for good (nats-py 2.16): Bus.flush
    never leaves a cancelled future behind, so after the heal the same connection flushes and
    receives again."""
    from tests.fixtures.net import Partition

    async with Partition(nats_server.port) as net:
        bus = await Bus.connect(net.url, role="tracker", name="partitioned")
        sender = await bus_factory("tracker", name="sender")
        try:
            healed = asyncio.Event()
            async with bus.subscribe("mesh.tracker.partition-test", NodeHeartbeat) as sub:
                async def read() -> None:
                    async for hb in sub:
                        if hb.node_id == "after-heal":
                            healed.set()

                reader = asyncio.create_task(read())
                net.cut()
                for _ in range(3):  # each PING goes unanswered while cut
                    with pytest.raises(BusTimeoutError):
                        await bus.flush(timeout=0.2)
                net.heal()
                await bus.flush(timeout=5.0)  # the late PONGs met their PINGs; this one is answered
                await sender.publish("mesh.tracker.partition-test", NodeHeartbeat(node_id="after-heal"))
                async with asyncio.timeout(10):
                    await healed.wait()
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
        finally:
            await bus.close()


def _open_sockets() -> int:
    """This process's open sockets."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return n


async def test_a_wrong_password_is_refused_at_once_not_retried(nats_server: NatsServer) -> None:
    """A wrong user or password cannot get better by retrying: the first connect gives up with
    BusConnectError (a server that is not up yet is still waited for)."""
    user, _ = nats_server.credentials("node")
    sockets = _open_sockets()
    async with asyncio.timeout(30):  # a guard: before, it retried every 250 ms for ever
        with pytest.raises(BusConnectError, match=r"(?i)authorization violation"):
            await Bus.connect(nats_server.url, role="node", user=user, password="wrong", name="n")
    await asyncio.sleep(0)  # a closed transport lets its socket go on the next loop turn
    assert _open_sockets() == sockets  # the refused connection's socket is closed, not left to the GC
    ok = await Bus.connect(nats_server.url, role="node", user=user, password=nats_server.credentials("node")[1])
    await ok.close()  # the right password still connects


def test_meshnet_nats_port_keeps_the_configs_address(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`meshnet nats --port` changes the port only: a config that listens on a reachable address
    (the README's across-machines step) keeps it; a config on loopback stays there; a bare port
    (every interface, to nats-server) stays on every interface."""
    from bus import server

    for listen, host in (("0.0.0.0:4222", "0.0.0.0"), ("127.0.0.1:4222", "127.0.0.1"), ("4222", "0.0.0.0")):
        conf = tmp_path / f"{host}.conf"
        conf.write_text(server.NATS_CONF.read_text().replace("listen: 127.0.0.1:4222", f"listen: {listen}"))
        assert server.main(["--config", str(conf), "--port", "14999", "--print-command"]) == 0
        run_conf = Path(capsys.readouterr().out.split()[-1])
        assert f"listen: {host}:14999" in run_conf.read_text()
    # a bare monitoring port is served on the listen host, as nats-server does: never wider
    conf = tmp_path / "bare-http.conf"
    conf.write_text(server.NATS_CONF.read_text().replace("http: 127.0.0.1:8222", "http: 8222"))
    assert server.main(["--config", str(conf), "--monitor-port", "18999", "--print-command"]) == 0
    assert "http: 127.0.0.1:18999" in Path(capsys.readouterr().out.split()[-1]).read_text()


def test_two_nats_servers_on_other_ports_keep_their_own_configs(capsys: pytest.CaptureFixture[str]) -> None:
    """Each derived config is a file of its own: starting a second `meshnet nats --port` does
    not rewrite the first one's (which its `--signal reload` would re-read)."""
    from bus import server

    paths = []
    for port in ("14997", "14998", "14997"):
        assert server.main(["--port", port, "--print-command"]) == 0
        paths.append(Path(capsys.readouterr().out.split()[-1]))
    assert paths[0] != paths[1] and paths[0] == paths[2]
    assert "14997" in paths[0].read_text() and "14998" in paths[1].read_text()


async def test_a_user_added_to_the_config_of_meshnet_nats_port_logs_in_after_a_reload(tmp_path: Path) -> None:
    """A user probe: a newcomer ran `meshnet nats --config my.conf --port P`, added node d's user
    to my.conf and sent nats-server SIGHUP, as nats.conf's comments say; node d was still refused
    ('Authorization Violation'): the server ran a copy of my.conf taken at start, and reloaded
    that. The run config now includes my.conf, so a reload reads the user."""
    import secrets
    import sys

    from bus.credentials import Credential, node_permissions
    from bus.natsconf import render_user
    from bus.server import free_port

    conf = tmp_path / "my.conf"
    conf.write_text((Path(__file__).parents[1] / "nats.conf").read_text())
    port, monitor = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bus.server", "--config", str(conf), "--port", str(port),
        "--monitor-port", str(monitor), "--store-dir", str(tmp_path / "store"),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)  # execs nats-server
    try:
        ok = await asyncio.wait_for(Bus.connect(f"nats://127.0.0.1:{port}", role="monitor"), 30)
        await ok.close()
        assert (tmp_path / "store" / "jetstream").is_dir()  # --store-dir still holds JetStream's store
        password = secrets.token_urlsafe(12)
        user = render_user(Credential(user="node-d", password=password), node_permissions("d"))
        text = conf.read_text()
        conf.write_text(text.replace("  ]\n}\n# END users", user + "\n  ]\n}\n# END users"))
        proc.send_signal(signal.SIGHUP)
        for _ in range(100):  # the reload is asynchronous: try until it has happened
            try:
                bus = await Bus.connect(f"nats://127.0.0.1:{port}", role="node", user="node-d",
                                        password=password, node_id="d")
                break
            except BusConnectError:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("node-d, added to the config and reloaded, is still refused")
        await bus.close()
    finally:
        proc.terminate()
        await proc.wait()


async def test_waiting_for_an_absent_server_is_said_once_not_four_times_a_second(
        caplog: pytest.LogCaptureFixture) -> None:
    """A user probe: a node started before its NATS server logged 46 lines in 12 s."""
    from bus.server import free_port

    caplog.set_level(logging.WARNING, logger="meshnet")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(Bus.connect(f"nats://127.0.0.1:{free_port()}", role="tracker"), 1.5)
    said = [r for r in caplog.records if "error during connect" in r.getMessage()]
    assert len(said) == 1 and "waiting for the server" in said[0].getMessage()


async def test_a_connect_error_without_a_message_is_still_named(caplog: pytest.LogCaptureFixture) -> None:
    """A node restarted while nats-server was frozen (SIGSTOP: TCP accepted, nothing said)
    logged 'nats error during connect to nats://...:  (waiting for the server; ...)' with
    nothing where the error goes: nats-py's TimeoutError has no message."""
    callbacks = _connect_callbacks({}, "node", "nats://127.0.0.1:1", None, [])
    with caplog.at_level(logging.WARNING, logger="meshnet.bus"):
        await callbacks["error_cb"](TimeoutError())
    assert "nats://127.0.0.1:1: TimeoutError (no answer from the server) (waiting" in caplog.text, caplog.text


class _Kept(list[Bus]):
    """Every Bus the code under test connects, in order; `first` is set once one is."""

    def __init__(self) -> None:
        super().__init__()
        self.first = asyncio.Event()


def _keep_buses(monkeypatch: pytest.MonkeyPatch) -> _Kept:
    made = _Kept()
    connect = Bus.connect

    async def keep(*args: object, **kwargs: object) -> Bus:
        bus = await connect(*args, **kwargs)  # type: ignore[arg-type]
        made.append(bus)
        made.first.set()
        return bus

    monkeypatch.setattr(Bus, "connect", keep)
    return made


async def _give_up(made: _Kept) -> None:
    """What nats-py does with a server -ERR it does not retry, for the first bus once it is up
    (the probe's: a subject past the control-line limit; the server's close of the socket may be
    read first instead, and then it reconnects: a race, so the -ERR is handed to it here)."""
    await made.first.wait()
    await made[0]._nc._process_err("'Maximum Control Line Exceeded'")


async def test_a_node_whose_bus_is_lost_ends_with_an_error(nats_server: NatsServer, model_path: Path,
                                                           bus_factory: BusFactory,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Both shards of a composite node stop (exit code 1), not only the one whose bus is lost."""
    from nodes.main import build_parser, serve
    from schemas.node import NodeAnnouncement

    watcher = await bus_factory("monitor")
    made = _keep_buses(monkeypatch)
    args = build_parser().parse_args(["--model", str(model_path), "--layers", "0:15", "--layers", "15:30",
                                      "--nats", nats_server.url, "--node-id", "lost-a", "--node-id", "lost-b"])
    async with watcher.subscribe(subjects.ANNOUNCE_ALL, NodeAnnouncement) as announced:
        node = asyncio.create_task(serve(args))
        serving = set()
        async with asyncio.timeout(120):
            async for msg in announced:  # both shards serve
                serving.add(msg.node_id)
                if serving == {"lost-a", "lost-b"}:
                    break
    await _give_up(made)
    assert await asyncio.wait_for(node, 60) == 1


async def test_a_node_whose_bus_is_lost_while_it_loads_ends_with_an_error(
        nats_server: NatsServer, model_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A bus lost between joining and serving (while the shard loads) ends the node with exit
    code 1 and one line, not a TimeoutError traceback ten seconds later."""
    from nodes.main import build_parser, serve

    made = _keep_buses(monkeypatch)
    args = build_parser().parse_args(["--model", str(model_path), "--layers", "0:30",
                                      "--nats", nats_server.url, "--node-id", "lost-early"])
    node = asyncio.create_task(serve(args))
    await _give_up(made)  # at once: the model is still loading
    assert await asyncio.wait_for(node, 60) == 1
    assert "lost-early: its NATS connection was lost for good" in capsys.readouterr().err


async def test_a_bus_the_client_gave_up_on_is_lost_and_ends_the_tracker(
        nats_server: NatsServer, bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """nats-py closes a connection for good on a server error it does not retry (a probe's
    5,000-character node id made the tracker write a subject past the control-line limit). The
    tracker lived on without a bus, and every chat got 503 no_tracker until someone restarted it:
    now the process ends with exit code 1, so its supervisor (`meshnet up`, systemd) starts it
    again. A bus closed on purpose is not lost."""
    from tracker.main import build_parser, run

    watcher = await bus_factory("node", name="n-watch")  # before the tracker's bus is the first one made
    made = _keep_buses(monkeypatch)
    user, password = nats_server.credentials("tracker")
    args = build_parser().parse_args(["--nats", nats_server.url, "--nats-user", user, "--nats-password", password,
                                      "--tracker-id", "t-lost", "--no-ledger"])
    async with watcher.subscribe(subjects.TRACKER_HELLO, TrackerHello) as hello:
        tracker = asyncio.create_task(run(args))
        await asyncio.wait_for(anext(aiter(hello)), 30)  # it runs (its hello asks nodes to announce)
    await _give_up(made)
    assert await asyncio.wait_for(tracker, 30) == 1
    assert made[0].lost.is_set()

    closed = await Bus.connect(nats_server.url, role="tracker", user=user, password=password, name="t-closed")
    await closed.close()
    await asyncio.sleep(0.2)
    assert not closed.lost.is_set()


async def test_a_role_pointed_at_the_monitoring_port_stops_with_a_hint(nats_server: NatsServer) -> None:
    """A user probe: `meshnet tracker --nats nats://127.0.0.1:8222` (the monitoring port, HTTP)
    logged 'TimeoutError (no answer from the server) (waiting for the server ...)' for ever; so
    did a node and a gateway (they share Bus.connect). Now the first timeout probes the port."""
    url = f"nats://127.0.0.1:{nats_server.monitor_port}"
    assert await speaks_http(url) and not await speaks_http(nats_server.url)
    async with asyncio.timeout(WAIT):  # a guard: before, it retried for ever
        with pytest.raises(BusConnectError, match=r"answers HTTP, not NATS: it looks like nats-server's monitoring"):
            await Bus.connect(url, role="tracker")


async def test_a_server_that_accepts_but_never_speaks_is_still_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    """The probe does not give up on a NATS server that is frozen (SIGSTOP: TCP accepted,
    nothing said, nothing answered): the connect keeps waiting for it, as before."""
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads, never answers
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    caplog.set_level(logging.WARNING, logger="meshnet")
    try:
        with pytest.raises(TimeoutError):  # our own wait, not BusConnectError
            await asyncio.wait_for(Bus.connect(f"nats://127.0.0.1:{port}", role="tracker"), 6)
    finally:
        server.close()
    assert "waiting for the server" in caplog.text


async def test_an_http_url_is_refused_at_once_naming_the_monitoring_port() -> None:
    """`--nats http://127.0.0.1:8222` (the monitoring page's address, copied from a browser):
    nats-py retried it for ever, logging 'Name or service not known'."""
    async with asyncio.timeout(WAIT):  # a guard: before, it retried for ever
        with pytest.raises(BusConnectError, match=r"http:// is not a NATS URL: give nats://host:port \(an http"):
            await Bus.connect("http://127.0.0.1:8222", role="tracker")
    assert scheme_problem("nats://h:4222") == scheme_problem("h:4222") == scheme_problem("tls://h") == ""
    assert scheme_problem("redis://h:6379") == "redis:// is not a NATS URL: give nats://host:port"
