"""`meshnet <command>`: dispatch to each plane's own entry point (imported lazily)."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "up": ("meshnet.up", "one-command local mesh: nats-server, tracker, nodes, gateway"),
    "node": ("nodes.main", "serve a shard of a model over HTTP and announce it on NATS"),
    "tracker": ("tracker.main", "run the tracker: registry, coverage map, route selection"),
    "gateway": ("gateway.main", "OpenAI-compatible gateway with live Generation Telemetry"),
    "watch": ("meshnet.watch", "live feed of everything on mesh.>"),
    "nats": ("bus.server", "run the embedded nats-server with the repo's nats.conf"),
    "artifact": ("meshnet.artifact", "Artifact Manifests, pieces per layer range, verify, seed (the Shard Swarm)"),
    "validator": ("validator.main", "replay sampled sessions on other routes or a reference; publish verdicts"),
    "ledger": ("meshnet.ledger", "what each node earned: inference work and seeding, from the Work Ledger"),
    "audit": ("meshnet.audit", "what this runtime can do with a GGUF, measured: whole model, layer ranges"),
}


def _usage() -> str:
    lines = ["usage: meshnet <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run `meshnet <command> [args]`; each command module exposes main(argv) -> int."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"meshnet: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
