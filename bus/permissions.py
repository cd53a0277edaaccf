"""Who may publish and subscribe to what on the bus (pure): one table per role, one per node.

nats.conf's users are rendered from these tables (bus/natsconf.py); `meshnet up` and the tests
render per-run users from the same tables, so the shipped file and generated ones never drift.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bus import subjects

# JetStream calls a publisher of audit events makes: find the MESH_AUDIT stream, create it if
# it is missing. Nobody but the tracker may read stored events back ($JS.API.STREAM.MSG.GET).
JS_AUDIT_CALLS = (
    "$JS.API.INFO",
    f"$JS.API.STREAM.INFO.{subjects.AUDIT_STREAM}",
    f"$JS.API.STREAM.CREATE.{subjects.AUDIT_STREAM}",
)
# Reading the Work Ledger's key-value bucket (never writing it: only the tracker does)
LEDGER_READ_CALLS = (
    "$JS.API.STREAM.INFO.KV_MESH_LEDGER",
    "$JS.API.DIRECT.GET.KV_MESH_LEDGER.>",
    "$JS.API.STREAM.MSG.GET.KV_MESH_LEDGER",
)
# Reading the audit stream through a durable consumer of one's own (the validator's verdicts)
JS_CONSUMER_CALLS = (
    f"$JS.API.CONSUMER.INFO.{subjects.AUDIT_STREAM}.>",
    f"$JS.API.CONSUMER.CREATE.{subjects.AUDIT_STREAM}.>",
    f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.AUDIT_STREAM}.>",
    f"$JS.API.CONSUMER.MSG.NEXT.{subjects.AUDIT_STREAM}.>",
    f"$JS.API.CONSUMER.DELETE.{subjects.AUDIT_STREAM}.>",  # made again from a sequence after a failure
    f"$JS.ACK.{subjects.AUDIT_STREAM}.>",
)
# The evidence bucket of verdicts (both runs' output ids): the validator writes it
VERDICT_BUCKET_CALLS = (
    "$JS.API.STREAM.INFO.KV_MESH_VERDICTS",
    "$JS.API.STREAM.CREATE.KV_MESH_VERDICTS",
    "$KV.MESH_VERDICTS.>",
)
SHARED = "*"  # node_id of the shared dev `node` user: any node id


@dataclass(frozen=True, slots=True)
class Permissions:
    """Allowed subjects to publish and subscribe (nats-server denies everything else)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    comment: str = ""


def _inbox(role: str, node_id: str | None = None) -> str:
    return f"{subjects.INBOX_ROOT}.node.{node_id}.>" if role == "node" else f"{subjects.INBOX_ROOT}.{role}.>"


def _tracker() -> Permissions:
    return Permissions(
        publish=(
            f"{subjects.PREFIX}.tracker.>",  # hello, status, rebalance; serves route.create
            subjects.DIRECTIVE_ALL,
            f"{subjects.PREFIX}.audit.*.tracker",
            f"{subjects.INBOX_ROOT}.>",  # replies to requests (route replies, key joins)
            "$JS.API.>",  # sets up and reads the audit stream, and the Work Ledger's bucket
            "$KV.MESH_LEDGER.>",  # writes the Work Ledger (tracker/ledger_service.py)
            "$KV.MESH_SESSIONS.>",  # every open route (a tracker that starts late reads them)
            "$KV.MESH_QUARANTINE.>",  # quarantines and lifts (tracker/quarantine_service.py)
            "$KV.MESH_ROUTE_ASKS.>",  # claims of route requests (one route per request, tracker/asks.py)
            f"$JS.ACK.{subjects.AUDIT_STREAM}.>",  # acknowledges what its ledger consumer counted
        ),
        subscribe=(subjects.ALL, subjects.NODE_KEY_ALL, _inbox("tracker")),
        comment="The tracker: registry, routes, directives, rebalance, audit stream setup; "
        "the only reader of meshkey.join.*.",
    )


def _gateway() -> Permissions:
    return Permissions(
        publish=(
            subjects.ROUTE_CREATE,
            subjects.ROUTE_RETRY,  # asked again of every tracker (gateway/routing.py)
            subjects.ROUTE_WITHDRAW,  # ... and given up on
            subjects.DIRECTIVE_ALL,  # close and abort
            subjects.DRIVER_ALIVE_ALL,  # it is alive: the hops keep its sessions
            subjects.TELEMETRY_ALL,
            f"{subjects.PREFIX}.audit.*.gateway",
            *JS_AUDIT_CALLS,
            *LEDGER_READ_CALLS,  # GET /v1/ledger
            _inbox("validator"),  # answers the validator's replay-record requests (only it reads them)
        ),
        subscribe=(subjects.ALL, _inbox("gateway")),
        comment="The gateway: asks for routes, publishes telemetry, close/abort directives "
        "and its own audit events.",
    )


def _validator() -> Permissions:
    return Permissions(
        publish=(
            subjects.ROUTE_CREATE,  # its replay routes
            subjects.ROUTE_RETRY,
            subjects.ROUTE_WITHDRAW,
            subjects.DIRECTIVE_ALL,  # closes them
            subjects.REPLAY_RECORD,  # asks the gateway for a sampled session's ids
            subjects.EVIDENCE_ALL,  # asks each hop for the rows it received and sent
            f"{subjects.PREFIX}.audit.*.validator",
            *JS_AUDIT_CALLS,
            *JS_CONSUMER_CALLS,
            *VERDICT_BUCKET_CALLS,
        ),
        subscribe=(subjects.ALL, _inbox("validator")),
        comment="The validator: reads the gateway's validation events, replays sampled sessions "
        "on other routes, publishes verdicts; the only user that may ask for a session's ids.",
    )


def _operator() -> Permissions:
    return Permissions(
        publish=(subjects.UNQUARANTINE,),
        subscribe=(_inbox("operator"),),
        comment="An operator's commands (`meshnet tracker unquarantine`): nothing else, so its login "
        "in `meshnet up`'s run file gives no more than that.",
    )


def _monitor() -> Permissions:
    return Permissions(
        publish=LEDGER_READ_CALLS,  # `meshnet ledger`
        subscribe=(subjects.ALL, _inbox("monitor")),
        comment="A monitor (`meshnet watch`, `nats sub 'mesh.>'`, `meshnet ledger`): reads mesh.> and "
        "the Work Ledger, never another party's inbox, publishes nothing else.",
    )


_ROLES: dict[str, Callable[[], Permissions]] = {
    "tracker": _tracker, "gateway": _gateway, "validator": _validator, "operator": _operator, "monitor": _monitor}


def role_permissions(role: str) -> Permissions:
    """The tracker's, the gateway's, the validator's, an operator's or a monitor's permissions."""
    if role not in _ROLES:
        raise ValueError(f"unknown role {role!r} (nodes: node_permissions)")
    return _ROLES[role]()


def node_permissions(node_id: str) -> Permissions:
    """What node `node_id` may do: publish only subjects carrying its own id, read directives,
    its own rebalance orders, hello/status and its own inbox. SHARED ("*") gives the dev user
    that any node may use (it can then speak for every node: development only)."""
    if node_id != SHARED:
        subjects.node_announce(node_id)  # validates the token
    n = node_id
    return Permissions(
        publish=(
            f"{subjects.PREFIX}.node.{n}.announce",
            f"{subjects.PREFIX}.node.{n}.heartbeat",
            f"{subjects.PREFIX}.node.{n}.spare",
            f"{subjects.PREFIX}.node.{n}.rebalance_reply",
            f"{subjects.PREFIX}.artifact.*.*.{n}",  # have, bad, progress (artifacts it seeds and fetches)
            subjects.ARTIFACT_PEERS,  # asks the tracker who seeds an artifact (the reply: its inbox)
            f"{subjects.PREFIX}.session.*.hop.{n}",
            f"{subjects.PREFIX}.audit.*.node.{n}",
            f"{subjects.KEY_PREFIX}.join.{n}",
            *JS_AUDIT_CALLS,
            _inbox("validator"),  # answers the validator's evidence requests (only it reads them)
        ),
        subscribe=(
            f"{subjects.PREFIX}.node.{n}.evidence",  # the validator asks for its Hop Evidence
            subjects.DIRECTIVE_ALL,
            subjects.DRIVER_ALIVE_ALL,  # the drivers of its sessions are alive
            f"{subjects.PREFIX}.tracker.rebalance.{n}",
            subjects.TRACKER_HELLO,
            subjects.TRACKER_STATUS,
            _inbox("node", n),
        ),
        comment=(
            "The shared dev node user: any node id (DEV ONLY: it can speak for every node)."
            if n == SHARED
            else f"Node {n}: only its own subjects."
        ),
    )
