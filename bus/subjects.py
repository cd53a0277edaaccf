"""Subject builders for the `mesh.` namespace (see docs/ and ARCHITECTURE.md)."""

from __future__ import annotations

import re

PREFIX = "mesh"
ROUTE_CREATE = f"{PREFIX}.tracker.route.create"
ALL = f"{PREFIX}.>"
AUDIT_ALL = f"{PREFIX}.audit.>"
ANNOUNCE_ALL = f"{PREFIX}.node.*.announce"
HEARTBEAT_ALL = f"{PREFIX}.node.*.heartbeat"
DIRECTIVE_ALL = f"{PREFIX}.route.*.directive"
TELEMETRY_ALL = f"{PREFIX}.session.*.telemetry"
REBALANCE_ALL = f"{PREFIX}.tracker.rebalance.>"
TRACKER_HELLO = f"{PREFIX}.tracker.hello"  # tracker -> nodes: (re-)announce now
TRACKER_STATUS = f"{PREFIX}.tracker.status"  # tracker -> monitors: periodic snapshot
# Secrets never travel under `mesh.>` (which monitors read): a node gives the tracker its frame
# key on `meshkey.join.<node_id>`, a subject only the tracker may read and only that node write.
KEY_PREFIX = "meshkey"
NODE_KEY_ALL = f"{KEY_PREFIX}.join.*"

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")


def _token(value: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"{value!r} is not a valid subject token")
    return value


def node_announce(node_id: str) -> str:
    return f"{PREFIX}.node.{_token(node_id)}.announce"


def node_heartbeat(node_id: str) -> str:
    return f"{PREFIX}.node.{_token(node_id)}.heartbeat"


def route_directive(route_id: str) -> str:
    return f"{PREFIX}.route.{_token(route_id)}.directive"


def session_telemetry(session_id: str) -> str:
    return f"{PREFIX}.session.{_token(session_id)}.telemetry"


def audit(kind: str) -> str:
    return f"{PREFIX}.audit.{_token(kind)}"


def rebalance(node_id: str) -> str:
    return f"{PREFIX}.tracker.rebalance.{_token(node_id)}"


def node_key(node_id: str) -> str:
    return f"{KEY_PREFIX}.join.{_token(node_id)}"
