"""Shared fixtures live in tests/fixtures/<topic>.py; import them here by name."""

# ruff: noqa: F403
from tests.fixtures.gateway import *  # GatewaySettings overrides of the scripted-route gateway
from tests.fixtures.mesh import *  # node processes, a tracker, routes (route tests)
from tests.fixtures.model import *  # bundled GGUF path, shard engines
from tests.fixtures.nats import *  # a real nats-server on free ports
from tests.fixtures.wan import *  # nodes behind delaying relays (WAN tests)
