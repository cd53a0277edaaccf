"""Subject builders for the `mesh.` namespace (see docs/ and ARCHITECTURE.md).

Every subject a party publishes names that party, so nats.conf can give each one exactly its
own subjects: a node's id is a token of everything it publishes (announce, heartbeat, hop
telemetry, audit, frame key), the gateway's and the tracker's audit subjects end in their role.
"""

from __future__ import annotations

import re

PREFIX = "mesh"
ROUTE_CREATE = f"{PREFIX}.tracker.route.create"
ROUTE_RETRY = f"{PREFIX}.tracker.route.retry"  # a route request asked again: every tracker reads it
ROUTE_WITHDRAW = f"{PREFIX}.tracker.route.withdraw"  # the asker gave up on a route request: every tracker reads it
ALL = f"{PREFIX}.>"
AUDIT_ALL = f"{PREFIX}.audit.>"
AUDIT_STREAM = "MESH_AUDIT"  # the JetStream stream that keeps AUDIT_ALL
ANNOUNCE_ALL = f"{PREFIX}.node.*.announce"
HEARTBEAT_ALL = f"{PREFIX}.node.*.heartbeat"
DIRECTIVE_ALL = f"{PREFIX}.route.*.directive"
TELEMETRY_ALL = f"{PREFIX}.session.*.telemetry"  # the gateway's GenerationTelemetry
DRIVER_ALIVE_ALL = f"{PREFIX}.driver.*.alive"  # a route driver (a gateway) is alive: nodes free the sessions of a silent one
HOP_TELEMETRY_ALL = f"{PREFIX}.session.*.hop.*"  # every hop's HopTelemetry
SESSION_ALL = f"{PREFIX}.session.>"  # both
REBALANCE_ALL = f"{PREFIX}.tracker.rebalance.>"
TRACKER_HELLO = f"{PREFIX}.tracker.hello"  # tracker -> nodes: (re-)announce now
TRACKER_STATUS = f"{PREFIX}.tracker.status"  # tracker -> monitors: periodic snapshot
SPARE_ALL = f"{PREFIX}.node.*.spare"  # spare nodes: "I can load a shard of this artifact"
REBALANCE_REPLY_ALL = f"{PREFIX}.node.*.rebalance_reply"  # a node's answer to a rebalance order
# Artifact plane (schemas/artifacts.py): what each seeder holds, bad-piece reports, fetch progress
ARTIFACT_PEERS = f"{PREFIX}.tracker.artifact.peers"  # request: who seeds artifact X (the tracker answers)
ARTIFACT_HAVE_ALL = f"{PREFIX}.artifact.*.have.*"
ARTIFACT_BAD_ALL = f"{PREFIX}.artifact.*.bad.*"
ARTIFACT_EVENTS = ("have", "bad", "progress")
# Secrets never travel under `mesh.>` (which monitors read): a node gives the tracker its frame
# key on `meshkey.join.<node_id>`, a subject only the tracker may read and only that node write.
KEY_PREFIX = "meshkey"
NODE_KEY_ALL = f"{KEY_PREFIX}.join.*"
# Replies to requests (route replies, JetStream acks) go to `_INBOX.<identity>.…`: each user
# may read only its own prefix, so nobody else sees the gateway's route replies.
INBOX_ROOT = "_INBOX"
ROLES = ("tracker", "gateway", "monitor", "node", "validator", "operator")
# Validation and quarantine (schemas/validation.py)
EVIDENCE_ALL = f"{PREFIX}.node.*.evidence"  # validator -> node: its Hop Evidence of a session
REPLAY_RECORD = f"{PREFIX}.gateway.replay"  # validator -> gateways: a sampled session's ids (reply: its inbox)
QUARANTINE = f"{PREFIX}.tracker.quarantine"  # tracker -> all: a node is out of new routes, or back
UNQUARANTINE = f"{PREFIX}.tracker.unquarantine"  # operator (tracker credentials) -> trackers: lift one
VERDICT_KIND = "validation_verdict"  # audit kind of a validator's verdict (mesh.audit.validation_verdict.validator)

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")


def _token(value: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"{value!r} is not a valid subject token")
    return value


def is_token(value: str) -> bool:
    """True if `value` can be one subject token (an id: [A-Za-z0-9_-]+)."""
    return bool(_TOKEN.match(value))


def node_announce(node_id: str) -> str:
    return f"{PREFIX}.node.{_token(node_id)}.announce"


def node_heartbeat(node_id: str) -> str:
    return f"{PREFIX}.node.{_token(node_id)}.heartbeat"


def driver_alive(driver_id: str) -> str:
    return f"{PREFIX}.driver.{_token(driver_id)}.alive"


def route_directive(route_id: str) -> str:
    return f"{PREFIX}.route.{_token(route_id)}.directive"


def session_telemetry(session_id: str) -> str:
    """The gateway's GenerationTelemetry of one session."""
    return f"{PREFIX}.session.{_token(session_id)}.telemetry"


def hop_telemetry(session_id: str, node_id: str) -> str:
    """One hop's HopTelemetry of one session, published by node `node_id`."""
    return f"{PREFIX}.session.{_token(session_id)}.hop.{_token(node_id)}"


def session_all(session_id: str) -> str:
    """Everything about one session: the gateway's telemetry and every hop's."""
    return f"{PREFIX}.session.{_token(session_id)}.>"


AUDIT_ROLES = ("tracker", "gateway", "validator")  # roles that publish audit events under their role's name


def publisher(role: str, node_id: str | None = None) -> str:
    """The publisher part of an audit subject: `tracker`, `gateway`, or `node.<node_id>`."""
    if role == "node":
        if node_id is None:
            raise ValueError("a node's audit subject needs its node_id")
        return f"node.{_token(node_id)}"
    if role not in AUDIT_ROLES:
        raise ValueError(f"role {role!r} publishes no audit events")
    return role


def audit(kind: str, by: str) -> str:
    """`mesh.audit.<kind>.<by>`, `by` from publisher(): who published it is in the subject, so
    nats.conf lets nobody publish under another party's name."""
    parts = by.split(".")
    if not ((len(parts) == 1 and parts[0] in AUDIT_ROLES) or (len(parts) == 2 and parts[0] == "node")):
        raise ValueError(f"{by!r} is not an audit publisher (see subjects.publisher)")
    for part in parts:
        _token(part)
    return f"{PREFIX}.audit.{_token(kind)}.{by}"


def audit_kind(kind: str) -> str:
    """Every audit event of one kind, whoever published it (to subscribe or filter)."""
    return f"{PREFIX}.audit.{_token(kind)}.>"


def artifact(event: str, artifact_id: str, node_id: str) -> str:
    """`mesh.artifact.<artifact_id>.<event>.<node_id>`: event is have, bad or progress."""
    if event not in ARTIFACT_EVENTS:
        raise ValueError(f"unknown artifact event {event!r}")
    return f"{PREFIX}.artifact.{_token(artifact_id)}.{event}.{_token(node_id)}"


def node_spare(node_id: str) -> str:
    return f"{PREFIX}.node.{_token(node_id)}.spare"


def rebalance_reply(node_id: str) -> str:
    return f"{PREFIX}.node.{_token(node_id)}.rebalance_reply"


def rebalance(node_id: str) -> str:
    return f"{PREFIX}.tracker.rebalance.{_token(node_id)}"


def node_evidence(node_id: str) -> str:
    """Validator -> node: a page of the rows it received and sent for a session (the reply: the
    validator's inbox)."""
    return f"{PREFIX}.node.{_token(node_id)}.evidence"


def node_key(node_id: str) -> str:
    return f"{KEY_PREFIX}.join.{_token(node_id)}"


def inbox_prefix(role: str, node_id: str | None = None) -> str:
    """The inbox prefix of a connection: `_INBOX.<role>`, or `_INBOX.node.<node_id>` for a node."""
    if role == "node":
        if node_id is None:
            raise ValueError("a node's inbox prefix needs its node_id")
        return f"{INBOX_ROOT}.node.{_token(node_id)}"
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    return f"{INBOX_ROOT}.{role}"


def bound_fields(subject: str) -> dict[str, str]:
    """The fields a message on `subject` must carry because the subject names them (pure).

    A node may publish only subjects with its own id (nats.conf); this makes the payload
    agree with the subject too, so a reader can trust `node_id` (or an audit event's `source`)
    as much as the subject. Subjects that name nothing give {}."""
    p = subject.split(".")
    if len(p) == 4 and p[:2] == [PREFIX, "node"] and p[3] in ("announce", "heartbeat", "spare", "rebalance_reply"):
        return {"node_id": p[2]}
    if len(p) == 5 and p[:2] == [PREFIX, "artifact"] and p[3] in ARTIFACT_EVENTS:
        return {"artifact_id": p[2], "node_id": p[4]}
    if len(p) == 4 and p[:2] == [PREFIX, "session"] and p[3] == "telemetry":
        return {"session_id": p[2]}
    if len(p) == 5 and p[:2] == [PREFIX, "session"] and p[3] == "hop":
        return {"session_id": p[2], "node_id": p[4]}
    if len(p) == 4 and p[:3] == [PREFIX, "tracker", "rebalance"]:
        return {"node_id": p[3]}
    if len(p) == 4 and p[:2] == [PREFIX, "audit"] and p[3] in AUDIT_ROLES:
        return {"kind": p[2], "source": p[3]}
    if len(p) == 5 and p[:2] == [PREFIX, "audit"] and p[3] == "node":
        return {"kind": p[2], "source": p[4], "node_id": p[4]}  # a node reports only its own work
    if len(p) == 3 and p[:2] == [KEY_PREFIX, "join"]:
        return {"node_id": p[2]}
    return {}


def binding_error(subject: str, msg: object) -> str | None:
    """Why `msg` may not travel on `subject` (a field disagrees with the subject), else None."""
    for name, want in bound_fields(subject).items():
        have = getattr(msg, name, None)
        if have is not None and have != want:
            return f"{name} {have!r} does not match the subject's {want!r}"
    return None
