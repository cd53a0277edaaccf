"""Per-node bus identity, enforced by a real nats-server: every node has its own user and may
publish only subjects that carry its id; each party reads only its own inbox prefix; readers
drop a message whose payload disagrees with its subject."""

from __future__ import annotations

import asyncio

import nats
import pytest

from bus import subjects
from bus.client import Bus
from bus.config import NATS_CONF
from bus.credentials import MeshCredentials
from bus.errors import BusPermissionError
from bus.natsconf import render_users, users_block
from bus.permissions import node_permissions
from bus.server import NatsServer
from schemas.audit import NodeWork, ValidationEvent
from schemas.base import BusMessage
from schemas.node import NodeAnnouncement, NodeHeartbeat
from schemas.rebalance import RebalanceDirective
from schemas.route import RouteDirective, RouteReply, RouteRequest, RouteSession
from schemas.sampling import SamplingParams
from schemas.telemetry import GenerationTelemetry, HopTelemetry
from tests.fixtures.nats import BusFactory
from tests.test_tracker_service import capability, until
from tracker.service import Tracker, TrackerConfig

WAIT = 30.0


def _announcement(node_id: str, url: str) -> NodeAnnouncement:
    return NodeAnnouncement(node_id=node_id, activation_url=url, capability=capability(0, 30), started_at=1.0)


def _directive(route_id: str) -> RouteDirective:
    session = RouteSession(session_id="s1", route_id=route_id, model="m", model_revision="r",
                           cache_abi="abi", n_layer=2, hidden_size=8, n_ctx=64, hops=[])  # fmt: skip
    return RouteDirective(action="abort", session=session, reason="forged", issued_by="node")


def _validation(source: str) -> ValidationEvent:
    return ValidationEvent(source=source, session_id="s1", route_id="r1", model="m", model_revision="r",
                           cache_abi="abi", hops=[], sampling=SamplingParams())  # fmt: skip


async def _refused(bus: Bus, subject: str, msg: BusMessage) -> bool:
    """True if the server refused `bus` publishing msg on subject."""
    try:
        await bus.publish(subject, msg, confirm=True)
    except BusPermissionError as exc:
        return exc.subject == subject.lower()
    return False


async def _subscribe_refused(bus: Bus, subject: str) -> bool:
    """True if the server refused `bus` a subscription to subject."""
    seen = len(bus.permission_errors)
    async with bus.subscribe_any(subject):
        await bus.flush()
        await asyncio.sleep(0.05)  # the -ERR follows the PONG on some servers
        await bus.flush()
    return any(p.operation == "subscription" and p.subject == subject.lower()
               for p in list(bus.permission_errors)[seen:])  # fmt: skip


def test_nats_conf_users_are_rendered_from_the_permission_tables() -> None:
    assert users_block(NATS_CONF.read_text()) == render_users(MeshCredentials.dev())


def test_a_node_user_publishes_only_subjects_with_its_own_id() -> None:
    perms = node_permissions("a")
    assert all(".a" in s or s.startswith("$JS.API.") or s == "_INBOX.validator.>" for s in perms.publish), perms.publish
    assert "_INBOX.node.a.>" in perms.subscribe and "mesh.tracker.rebalance.a" in perms.subscribe
    with pytest.raises(ValueError):
        node_permissions("a.b")  # not a subject token: would widen the permissions


async def test_a_node_cannot_speak_for_others(nats_server: NatsServer, bus_factory: BusFactory) -> None:
    await nats_server.add_node("a")
    await nats_server.add_node("b")
    tracker = await bus_factory("tracker")
    a = await bus_factory("node", node_id="a")
    assert nats_server.credentials("node", node_id="a")[0] == "node-a"
    async with tracker.subscribe_any(subjects.ALL) as everything:
        await tracker.flush()
        forged = [
            (subjects.route_directive("r1"), _directive("r1")),
            (subjects.rebalance("a"), RebalanceDirective(node_id="a", model="m", layer_start=0, layer_end=1, reason="x")),
            (subjects.node_heartbeat("b"), NodeHeartbeat(node_id="b")),
            (subjects.node_announce("b"), _announcement("b", "http://a")),
            (subjects.hop_telemetry("s1", "b"), HopTelemetry(session_id="s1", route_id="r1", node_id="b",
                                                             hop_index=0, layer_start=0, layer_end=1,
                                                             phase="decode")),
            (subjects.session_telemetry("s1"), GenerationTelemetry(session_id="s1", model="m", phase="decode")),
            (subjects.audit("validation", "gateway"), _validation("gateway")),
            (subjects.audit("node_work", "node.b"), NodeWork(source="b", session_id="s", route_id="r", node_id="b",
                                                             model_revision="r", layer_start=0, layer_end=1)),
            (subjects.node_key("b"), NodeHeartbeat(node_id="b")),
        ]
        for subject, msg in forged:
            assert await _refused(a, subject, msg), subject
        # its own subjects go through (the marker ends the collection: same connection, so in order)
        await a.publish(subjects.node_announce("a"), _announcement("a", "http://a"), confirm=True)
        await a.publish(subjects.node_heartbeat("a"), NodeHeartbeat(node_id="a"), confirm=True)
        got = []
        async for subject, _msg in everything.with_subjects():
            got.append(subject)
            if subject == subjects.node_heartbeat("a"):
                break
    assert got == [subjects.node_announce("a"), subjects.node_heartbeat("a")]
    # audit: its own subject is stored; under the gateway's name the bus refuses before sending
    assert await a.publish_audit(NodeWork(source="a", session_id="s", route_id="r", node_id="a",
                                          model_revision="r", layer_start=0, layer_end=1)) >= 1  # fmt: skip
    with pytest.raises(ValueError):
        await a.publish_audit(_validation("gateway"))
    assert await tracker.audit_count(subjects.audit_kind("validation")) == 0
    assert a.is_connected


async def test_a_node_reads_only_what_is_meant_for_it(nats_server: NatsServer, bus_factory: BusFactory) -> None:
    await nats_server.add_node("a")
    a = await bus_factory("node", node_id="a")
    for subject in (subjects.rebalance("b"), subjects.REBALANCE_ALL, "meshkey.>", subjects.NODE_KEY_ALL,
                    "_INBOX.>", "_INBOX.gateway.>", "_INBOX.node.b.>", subjects.AUDIT_ALL, subjects.ALL):
        assert await _subscribe_refused(a, subject), subject
    for subject in (subjects.rebalance("a"), subjects.DIRECTIVE_ALL, subjects.TRACKER_HELLO):
        assert not await _subscribe_refused(a, subject), subject


async def test_the_monitor_reads_mesh_but_no_inbox_and_no_keys(bus_factory: BusFactory) -> None:
    tracker = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    monitor = await bus_factory("monitor")
    for subject in ("_INBOX.>", "_INBOX.gateway.>", "meshkey.>", ">"):
        assert await _subscribe_refused(monitor, subject), subject
    await tracker.serve(subjects.ROUTE_CREATE, RouteRequest, lambda _req: RouteReply())
    async with monitor.subscribe_any(subjects.ALL) as sub:
        await monitor.flush()
        reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="m"), RouteReply, timeout=WAIT)
        assert reply.session is None  # the tracker answered, on the gateway's own inbox
        assert isinstance(await sub.next(WAIT), RouteRequest)  # the request is on mesh.>, the reply is not
    assert gateway._nc._inbox_prefix.decode() == "_INBOX.gateway"


async def test_the_announce_takeover_probe_fails(nats_server: NatsServer, bus_factory: BusFactory) -> None:
    """Node B's user republishes node A's announcement with B's URL: refused by the server on
    A's subject, dropped by the tracker on B's own; the registry keeps A's URL."""
    await nats_server.add_node("a")
    await nats_server.add_node("b")
    tbus = await bus_factory("tracker")
    a = await bus_factory("node", node_id="a")
    b = await bus_factory("node", node_id="b")
    async with Tracker(tbus, TrackerConfig()) as tracker:
        await a.publish(subjects.node_announce("a"), _announcement("a", "http://a:1"))
        await until(lambda: "a" in tracker.registry)
        takeover = _announcement("a", "http://b:1")
        assert await _refused(b, subjects.node_announce("a"), takeover)
        await b.publish(subjects.node_announce("b"), takeover, confirm=True)  # A's payload, B's subject
        await b.publish(subjects.node_heartbeat("b"), NodeHeartbeat(node_id="a", load=0.9), confirm=True)
        await b.publish(subjects.node_announce("b"), _announcement("b", "http://b:1"), confirm=True)
        await until(lambda: "b" in tracker.registry)  # B's own announcement, after the forged ones
        state = tracker.registry.get("a")
        assert state is not None and state.announcement.activation_url == "http://a:1"
        assert state.heartbeat is None or state.heartbeat.load != 0.9
        assert tracker.registry.get("b").announcement.activation_url == "http://b:1"  # type: ignore[union-attr]


async def test_the_shared_dev_user_still_cannot_put_one_node_id_on_anothers_subject(
    bus_factory: BusFactory,
) -> None:
    """With the dev `node` user any node may use any node subject; the payload check remains."""
    tracker = await bus_factory("tracker")
    dev = await bus_factory("node", name="x")
    async with tracker.subscribe(subjects.HEARTBEAT_ALL, NodeHeartbeat) as sub:
        await tracker.flush()
        await dev.publish(subjects.node_heartbeat("y"), NodeHeartbeat(node_id="x"))
        await dev.publish(subjects.node_heartbeat("y"), NodeHeartbeat(node_id="y"))
        assert (await sub.next(WAIT)).node_id == "y"
        assert sub.n_schema_errors == 1 and sub.schema_errors[0].kind == "subject_mismatch"


async def test_generated_users_replace_the_dev_ones(tmp_path) -> None:  # type: ignore[no-untyped-def]
    creds = MeshCredentials.generate(["a"])
    async with NatsServer.start(store_dir=tmp_path / "js", users=creds) as srv:
        assert srv.effective_config.stat().st_mode & 0o777 == 0o600
        assert "tracker-dev" not in srv.effective_config.read_text()
        with pytest.raises(Exception, match=r"(?i)authorization"):  # the dev password
            await nats.connect(srv.url, user="tracker", password="tracker-dev", allow_reconnect=False)
        user, password = srv.credentials("node", node_id="a")
        node = await Bus.connect(srv.url, role="node", user=user, password=password, node_id="a")
        try:
            await srv.add_node("c")  # a reload keeps connected clients
            assert await node.publish_audit(NodeWork(source="a", session_id="s", route_id="r", node_id="a",
                                                     model_revision="r", layer_start=0, layer_end=1)) == 1
            assert node.is_connected
        finally:
            await node.close()


async def test_a_node_given_another_nodes_user_is_refused_at_connect(nats_server: NatsServer) -> None:
    """A user probe: `meshnet node --node-id g` started with node-b's login (a copied command
    line) said 'serving', then logged a refused announcement or heartbeat every second for
    ever and never joined; a seeder without --node-id (a random id) did the same. Connecting
    as a node now checks that the user may speak as that id, and says what to do."""
    from bus.client import connect_node
    from bus.errors import BusConnectError

    user, password = (await nats_server.add_node("b")).user, nats_server.credentials("node", node_id="b")[1]
    with pytest.raises(BusConnectError, match=r"NATS user 'node-b' may not act as node 'g'.*node-g"):
        await connect_node(nats_server.url, user=user, password=password, node_id="g")
    own = await connect_node(nats_server.url, user=user, password=password, node_id="b")
    await own.close()
    shared_user, shared_password = nats_server.credentials("node", node_id="dev")  # the dev user: any id
    dev = await connect_node(nats_server.url, user=shared_user, password=shared_password, node_id="dev")
    await dev.close()


async def test_a_gateway_given_the_monitors_user_is_refused_at_connect(nats_server: NatsServer) -> None:
    """A user probe: a gateway started with the monitor's login (read-only) came up, then
    answered every chat 503 'no tracker answered within 5s (the trackers ... are down)', its
    route asks refused by the server. Connecting as a role now checks the user is that role's."""
    from bus.client import connect_as
    from bus.errors import BusConnectError

    user, password = nats_server.credentials("monitor")
    with pytest.raises(BusConnectError, match=r"NATS user 'monitor' may not act as the gateway.*\(gateway\)"):
        await connect_as(nats_server.url, "gateway", user=user, password=password, name="gw")
    for role in ("gateway", "tracker", "validator", "monitor"):
        user, password = nats_server.credentials(role)
        bus = await connect_as(nats_server.url, role, user=user, password=password, name=role)
        await bus.close()


async def test_meshnet_artifact_seed_with_a_wrong_login_says_so(nats_server: NatsServer, tmp_path) -> None:
    """`meshnet artifact seed` with a wrong password ended in a traceback (exit 1), and with a
    user not its id's ran on refused for ever; both now end with one line and exit 2."""
    import sys

    from artifacts.bundled import resolve_model

    cred = await nats_server.add_node("seed-b")
    for password, node_id, said in (("wrong", "seed-b", "Authorization Violation"),
                                    (cred.password, "other", "may not act as node 'other'")):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "meshnet.artifact", "seed", str(resolve_model(None)), "--port", "0",
            "--node-id", node_id, "--nats", nats_server.url, "--nats-user", cred.user, "--nats-password", password,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 2, (out, err)
        assert said in err.decode() and "Traceback" not in err.decode(), err.decode()


async def test_meshnet_gateway_with_a_wrong_login_says_so_in_one_line(nats_server: NatsServer) -> None:
    """`meshnet gateway` with a wrong password (or another role's user) ended in a traceback."""
    import sys

    from bus.server import free_port

    user, password = nats_server.credentials("monitor")
    for login, said in ((("gateway", "wrong"), "Authorization Violation"),
                        ((user, password), "may not act as the gateway")):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "meshnet.cli", "gateway", "--port", str(free_port()), "--nats", nats_server.url,
            "--nats-user", login[0], "--nats-password", login[1],
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 2, (out, err)
        assert said in err.decode() and "Traceback" not in err.decode(), err.decode()
