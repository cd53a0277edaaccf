"""Bus settings: server URL and role credentials from flags, environment, or dev defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_URL = "nats://127.0.0.1:4222"
ENV_URL = "MESHNET_NATS_URL"
ENV_USER = "MESHNET_NATS_USER"
ENV_PASSWORD = "MESHNET_NATS_PASSWORD"

# Dev credentials per role; they must match the users in the repo's nats.conf.
DEV_CREDENTIALS: dict[str, tuple[str, str]] = {
    "tracker": ("tracker", "tracker-dev"),
    "node": ("node", "node-dev"),
    "gateway": ("gateway", "gateway-dev"),
    "monitor": ("monitor", "monitor-dev"),
    "validator": ("validator", "validator-dev"),
    "operator": ("operator", "operator-dev"),
}
ROLES = tuple(DEV_CREDENTIALS)

REPO_ROOT = Path(__file__).resolve().parent.parent
NATS_CONF = REPO_ROOT / "nats.conf"


class UnknownRoleError(ValueError):
    """A role that has no entry in nats.conf."""

    def __init__(self, role: str) -> None:
        super().__init__(f"unknown bus role {role!r}; known roles: {', '.join(ROLES)}")
        self.role = role


def dev_credentials(role: str) -> tuple[str, str]:
    """The (user, password) pair nats.conf defines for `role`."""
    try:
        return DEV_CREDENTIALS[role]
    except KeyError:
        raise UnknownRoleError(role) from None


@dataclass(frozen=True, slots=True)
class BusSettings:
    """Where the bus is and who we are on it."""

    url: str = DEFAULT_URL
    role: str = "node"
    user: str | None = None
    password: str | None = None

    @classmethod
    def resolve(
        cls,
        role: str,
        *,
        url: str | None = None,
        user: str | None = None,
        password: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> BusSettings:
        """Flags win over environment, environment over the role's dev defaults."""
        env = os.environ if env is None else env
        dev_user, dev_password = dev_credentials(role)
        return cls(
            url=url or env.get(ENV_URL) or DEFAULT_URL,
            role=role,
            user=user or env.get(ENV_USER) or dev_user,
            password=password or env.get(ENV_PASSWORD) or dev_password,
        )

    @classmethod
    def from_args(cls, role: str, args: argparse.Namespace) -> BusSettings:
        """Resolve from the flags added by `add_bus_arguments`."""
        return cls.resolve(
            role,
            url=getattr(args, "nats", None),
            user=getattr(args, "nats_user", None),
            password=getattr(args, "nats_password", None),
        )


def add_bus_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --nats, --nats-user, --nats-password to a command's parser."""
    group = parser.add_argument_group("NATS")
    group.add_argument("--nats", metavar="URL", help=f"NATS URL (env {ENV_URL}, default {DEFAULT_URL})")
    group.add_argument("--nats-user", help=f"NATS user (env {ENV_USER}, default: the role's dev user)")
    group.add_argument("--nats-password", help=f"NATS password (env {ENV_PASSWORD})")
