"""Bus credentials: one user per role and, optionally, one per node (typed, generated per run).

The dev table (`MeshCredentials.dev()`) matches the repo's nats.conf. `generate(node_ids)`
makes fresh random passwords for a run (`meshnet up`, tests); `bus.natsconf` renders either
into nats-server users with the permissions of bus/permissions.py.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping

from pydantic import BaseModel, Field, TypeAdapter

from bus import subjects
from bus.permissions import SHARED, Permissions, node_permissions, role_permissions

NODE_USER_PREFIX = "node-"  # node X's own user is `node-X`; the shared dev user is `node`


class Credential(BaseModel):
    """One NATS user and its password."""

    user: str
    password: str


class MeshCredentials(BaseModel):
    """Every user a nats-server should know, by role, plus one per node id."""

    tracker: Credential
    gateway: Credential
    monitor: Credential
    validator: Credential | None = None  # the replay validator (`meshnet validator`)
    operator: Credential | None = None  # operator commands (`meshnet tracker unquarantine`)
    shared_node: Credential | None = None  # the dev `node` user any node may use
    nodes: dict[str, Credential] = Field(default_factory=dict)

    @classmethod
    def dev(cls) -> MeshCredentials:
        """The fixed dev users of the repo's nats.conf (loopback development only)."""
        from bus.config import DEV_CREDENTIALS

        def cred(role: str) -> Credential:
            user, password = DEV_CREDENTIALS[role]
            return Credential(user=user, password=password)

        return cls(tracker=cred("tracker"), gateway=cred("gateway"), monitor=cred("monitor"),
                   validator=cred("validator"), operator=cred("operator"), shared_node=cred("node"))  # fmt: skip

    @classmethod
    def generate(cls, node_ids: Iterable[str] = (), *, shared_node: bool = False) -> MeshCredentials:
        """Fresh random passwords for tracker, gateway, monitor and each node id."""
        creds = cls(tracker=_fresh("tracker"), gateway=_fresh("gateway"), monitor=_fresh("monitor"),
                    validator=_fresh("validator"), operator=_fresh("operator"), shared_node=_fresh("node") if shared_node else None)  # fmt: skip
        for node_id in node_ids:
            creds = creds.with_node(node_id)
        return creds

    def with_node(self, node_id: str) -> MeshCredentials:
        """A copy that also has node `node_id`'s own user (kept if it already has one)."""
        subjects.node_announce(node_id)  # a node id must be a subject token
        if node_id in self.nodes:
            return self
        return self.model_copy(update={"nodes": {**self.nodes, node_id: _fresh(NODE_USER_PREFIX + node_id)}})

    def for_role(self, role: str, node_id: str | None = None) -> Credential:
        """The credential a party uses: a node's own user when it has one, else the shared one."""
        if role == "node":
            if node_id is not None and node_id in self.nodes:
                return self.nodes[node_id]
            if self.shared_node is None:
                raise KeyError(f"no bus user for node {node_id!r} (and no shared node user)")
            return self.shared_node
        if role not in ("tracker", "gateway", "monitor", "validator", "operator"):
            raise KeyError(f"unknown bus role {role!r}")
        cred = getattr(self, role)
        if cred is None:
            raise KeyError(f"no bus user for role {role!r}")
        return cred

    def users(self) -> list[tuple[Credential, Permissions]]:
        """Every user with its permissions, in config order."""
        out = [(self.tracker, role_permissions("tracker"))]
        if self.shared_node is not None:
            out.append((self.shared_node, node_permissions(SHARED)))
        out += [(self.gateway, role_permissions("gateway")), (self.monitor, role_permissions("monitor"))]
        if self.validator is not None:
            out.append((self.validator, role_permissions("validator")))
        if self.operator is not None:
            out.append((self.operator, role_permissions("operator")))
        out += [(cred, node_permissions(node_id)) for node_id, cred in sorted(self.nodes.items())]
        return out


def _fresh(user: str) -> Credential:
    return Credential(user=user, password=secrets.token_urlsafe(24))


NODE_CREDENTIALS_ENV = "MESHNET_NODE_CREDENTIALS"  # a composite node's bus users, one per shard (JSON)
_NODE_TABLE = TypeAdapter(dict[str, Credential])


def node_credentials_env(creds: Mapping[str, Credential]) -> str:
    """The value of NODE_CREDENTIALS_ENV that gives each node id of a composite node its own
    bus user (never argv: `ps` shows that)."""
    return _NODE_TABLE.dump_json(dict(creds)).decode()


def node_credentials_from_env(env: Mapping[str, str]) -> dict[str, Credential]:
    """The bus users NODE_CREDENTIALS_ENV hands out by node id ({} when unset)."""
    raw = env.get(NODE_CREDENTIALS_ENV)
    return _NODE_TABLE.validate_json(raw) if raw else {}
