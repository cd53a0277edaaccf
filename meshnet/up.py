"""`meshnet up`: the one-command local mesh on the embedded defaults.

Starts nats-server with the repo's nats.conf and fresh bus users for this run (one per node),
the tracker, N nodes that split the
bundled model into contiguous layer ranges (each range served by --replicas nodes), and the
gateway; waits until a full route exists, prints the endpoints and an example. The nodes of one
replica of the model run as one composite node process (nodes/composite.py): their model calls
take turns on its one engine thread, so nothing arbitrates the cores between processes. A child that
crashes is reported and started again after a back-off, while the rest keeps serving; only
Ctrl-C (or SIGTERM), or the end of nats-server itself, stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from artifacts.bundled import model_id
from bus.cli_args import number
from bus.cli_args import port as port_number
from bus.config import ENV_PASSWORD, ENV_USER
from bus.credentials import NODE_CREDENTIALS_ENV, Credential, MeshCredentials, node_credentials_env
from bus.runinfo import RunInfo, remove_run_file, run_file_path, write_run_file
from bus.server import NatsServer, free_port
from gateway.api_keys import API_KEYS_ENV, key_arg, key_file_arg, keys_from_env
from gateway.route_client import is_loopback_host
from nodes.torch_engine import TORCH_ARCHS
from schemas.capability import DEFAULT_CTX, KV_PROFILES, MAX_CTX, MIN_CTX, usual_kv_profile
from schemas.frames import MAX_RUN_FLUSH_MS
from wire.client import authority

if TYPE_CHECKING:
    from artifacts.shard_file import ModelInfo

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Child:
    """A child process whose output is relayed with a name prefix."""

    name: str
    argv: list[str]
    proc: asyncio.subprocess.Process | None = None
    relay: asyncio.Task[None] | None = None
    lines: list[str] = field(default_factory=list)

    async def start(self, env: dict[str, str], verbose: bool) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.relay = asyncio.create_task(self._relay(verbose))

    async def restart(self, env: dict[str, str], verbose: bool) -> None:
        """Start the (exited) process again with the same command line."""
        if self.relay:
            self.relay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.relay
        await self.start(env, verbose)

    async def _relay(self, verbose: bool) -> None:
        assert self.proc and self.proc.stdout
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.lines = [*self.lines[-49:], line]
            if verbose:
                print(f"  {self.name:<10}| {line}", flush=True)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    async def stop(self, timeout: float = 5.0) -> None:
        if self.proc and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        if self.relay:
            self.relay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.relay


RESTART_BASE_S = 1.0
RESTART_MAX_S = 30.0
CRASH_WINDOW_S = 60.0  # crashes longer ago than this no longer lengthen the back-off


def restart_delay(recent_crashes: int) -> float:
    """Seconds before a crashed child starts again (pure): 1 s after its first crash within
    the window, doubling with each further one, at most 30 s."""
    return min(RESTART_MAX_S, RESTART_BASE_S * 2 ** max(0, recent_crashes - 1))


def node_ids(n_ranges: int, replicas: int) -> list[list[str]]:
    """Node ids per layer range: node-<range>, or node-<range>-<replica> with replicas."""
    if replicas < 1:
        raise ValueError("--replicas must be at least 1")
    if replicas == 1:
        return [[f"node-{i}"] for i in range(n_ranges)]
    return [[f"node-{i}-{r}" for r in range(replicas)] for i in range(n_ranges)]


def composite_groups(ids_per_range: list[list[str]]) -> list[list[str]]:
    """The node ids each composite node process serves (pure): one process per replica, its
    shards in layer order, so a replica's whole route shares one engine thread."""
    replicas = len(ids_per_range[0]) if ids_per_range else 0
    return [[ids[r] for ids in ids_per_range] for r in range(replicas)]


def process_threads(requested: int | None, replicas: int, cores: int) -> int | None:
    """Threads of each composite node process (pure): as asked, else all the cores for one
    process (None: the node's default), a share each for several (replicas side by side)."""
    if requested or replicas <= 1:
        return requested
    return max(1, cores // replicas)


def bus_env(cred: Credential) -> dict[str, str]:
    """The environment that gives a child its bus login (never argv: `ps` shows that)."""
    return {ENV_USER: cred.user, ENV_PASSWORD: cred.password}


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _nats_ports(requested: int | None) -> tuple[int, int]:
    """nats.conf's ports (4222/8222) unless taken or overridden; 0 means a free port."""
    if requested is not None:
        return requested, 0
    if _port_free(4222) and _port_free(8222):
        return 4222, 8222
    print("[up] ports 4222/8222 are busy; nats-server takes free ports instead", flush=True)
    return 0, 0


GATEWAY_FLAGS = ("token_flush_ms", "max_sessions", "max_queue", "queue_timeout", "validate_rate")  # passed through when given


def gateway_flags(args: argparse.Namespace) -> list[str]:
    """The `meshnet gateway` flags `meshnet up` passes on: those of GATEWAY_FLAGS the user gave."""
    out: list[str] = []
    for name in GATEWAY_FLAGS:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def gateway_keys(host: str, given: list[str] | None) -> tuple[list[str], bool]:
    """The API keys the gateway requires and whether they were generated here: the given ones;
    none on a loopback host; else one fresh random key (a gateway others can reach is never open
    by default)."""
    if given:
        return list(given), False
    if is_loopback_host(host):
        return [], False
    return [secrets.token_urlsafe(24)], True


def _fraction(raw: str) -> float:
    value = float(raw)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return value


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="meshnet up", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=number(1, integer=True), default=2,
                   help="number of Shards splitting the model, cut where each costs about the same per "
                        "token (the tail also runs the output head; default 2)")
    p.add_argument("--trackers", type=int, default=1, choices=range(1, 9), metavar="N",
                   help="trackers in one queue group (default 1); with 2 or more, any one may die")
    p.add_argument("--replicas", type=number(1, integer=True), default=1,
                   help="nodes serving each range (default 1; 2: a lost node's sessions restart on its replica)")
    p.add_argument("--port", type=port_number, default=8000, help="gateway port on --host (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="the gateway's address (default 127.0.0.1)")
    p.add_argument("--model", default=None, help="GGUF path (default: the bundled SmolLM2)")
    p.add_argument("--backend", default="llama", choices=["llama", "torch"])
    p.add_argument("--threads", type=number(1, integer=True), default=None, help="threads per node")
    p.add_argument("--kv-profile", default=None, choices=KV_PROFILES,
                   help="every llama.cpp node's and the validator's --kv-profile (exact: calls of several rows "
                        "give each row a single step's bits, so the gateway speculates and a restart replays "
                        "in one batch, both exactly; default: llama.cpp's own cache). Default: exact wherever "
                        "the model's head dimension allows a q8_0 K, as `meshnet node`")
    p.add_argument("--ctx", type=number(MIN_CTX, MAX_CTX, integer=True), default=None, metavar="TOKENS",
                   help=f"context size per session on every node and the validator (default {DEFAULT_CTX}); "
                        "a node's KV budget then holds fewer sessions")
    p.add_argument("--kv-memory", type=_bytes, default=None, metavar="BYTES",
                   help="every node's --kv-memory: bytes of KV cache each shard may hold, e.g. 2G (default 1G); "
                        "a --ctx whose one session does not fit it is refused")
    p.add_argument("--draft-model", type=Path, default=None, metavar="PATH.gguf",
                   help="the head's drafter for speculative decoding (`meshnet node --draft-model`): a small "
                        "GGUF of the model's vocabulary (default: prompt lookup, no model)")
    p.add_argument("--token-flush-ms", type=number(0, MAX_RUN_FLUSH_MS, integer=True), default=None,
                   help="the gateway's --token-flush-ms (0: stream every token as it comes)")
    p.add_argument("--max-sessions", type=number(1, integer=True), default=None,
                   help="the gateway's --max-sessions (concurrent Route Sessions; more requests queue)")
    p.add_argument("--max-queue", type=number(0, integer=True), default=None,
                   help="the gateway's --max-queue (requests that may wait for a route)")
    p.add_argument("--queue-timeout", type=number(0), default=None,
                   help="the gateway's --queue-timeout (seconds a request may wait for a route)")
    p.add_argument("--api-key", action="append", type=key_arg, default=None, metavar="KEY",
                   help="the gateway's --api-key (repeatable; also MESHNET_API_KEYS or --api-key-file, which "
                        "stay out of ps). Default: open on a loopback --host, a freshly generated key (printed) "
                        "on any other")
    p.add_argument("--api-key-file", type=key_file_arg, default=(), metavar="PATH",
                   help="read the gateway's API keys from this file, one per line (# comments); read once at start")
    p.add_argument("--validate-rate", type=_fraction, default=None,
                   help="the gateway's --validate-rate (fraction of sessions the validator replays; default 0.05)")
    p.add_argument("--validator", default="llama.cpp", choices=("llama.cpp", "torch", "none", "off"),
                   help="the replay validator's reference engine (`meshnet validator --reference`); "
                        "off: no validator (default llama.cpp)")
    p.add_argument("--nats-port", type=int, default=None, help="override nats.conf's port (0: a free port)")
    p.add_argument("--quiet", action="store_true", help="do not relay child logs")
    return p.parse_args(argv)


class Interrupted(RuntimeError):
    """Ctrl-C (or SIGTERM) arrived while the mesh was still starting."""


async def _wait_ready(
    url: str, children: list[Child], what: str, timeout: float, stop: asyncio.Event
) -> None:
    """Poll `url` until 200, failing early if a child exits or the user interrupts."""
    t0 = time.monotonic()
    last = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while True:
            if stop.is_set():
                raise Interrupted(f"interrupted while waiting for {what}")
            for c in children:
                if c.exited() is not None:
                    tail = "\n".join(c.lines[-15:])
                    raise RuntimeError(f"{c.name} exited with code {c.exited()}:\n{tail}")
            try:
                async with http.get(url) as r:
                    if r.status == 200:
                        return
                    last = (await r.text())[:200]
            except (TimeoutError, aiohttp.ClientError) as exc:  # a node still loading may not answer in time
                last = type(exc).__name__
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{what} not ready after {timeout:.0f}s ({last})")
            await asyncio.sleep(0.5)


@dataclass
class MeshPlan:
    """The children `meshnet up` starts, in order, with each one's environment (its bus login);
    `node_urls` maps a composite node process to its node ids' URLs."""

    children: list[Child]
    envs: dict[str, dict[str, str]]
    node_urls: dict[str, dict[str, str]]
    keys: list[str]
    generated_keys: bool


def _plan_children(args: argparse.Namespace, model: Path, ranges: list[tuple[int, int]], ids: list[list[str]],
                   profile: str, creds: MeshCredentials, nats_url: str) -> MeshPlan:
    """Trackers, one composite node process per replica (`ids`: node_ids' groups), the validator and the gateway."""
    exe = [sys.executable, "-m", "meshnet.cli"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    nats_args = ["--nats", nats_url]
    # --trackers N: a queue group of trackers (any one may die; the others serve on)
    names = ["tracker"] if args.trackers == 1 else [f"tracker-{i}" for i in range(args.trackers)]
    # --replicas N is the trackers' target: a range down to fewer live nodes is under-provisioned
    # (amber on the console's Coverage Map), not "covered" as with the default target of 1
    target = ["--target-replicas", str(args.replicas)]
    children = [Child(n, [*exe, "tracker", "--tracker-id", n, *target, *nats_args]) for n in names]
    envs = {n: {**env, **bus_env(creds.tracker)} for n in names}
    node_urls: dict[str, dict[str, str]] = {}
    for group in composite_groups(ids):
        child, urls, envs[child.name] = _composite_child(args, model, ranges, group, profile, creds, env, nats_args)
        children.append(child)
        node_urls[child.name] = urls
    if args.validator != "off":  # replays the sessions the gateway samples (docs/validation.md)
        ctx_flag = ["--ctx", str(args.ctx)] if args.ctx is not None else []  # it replays whole sessions
        children.append(Child("validator", [*exe, "validator", "--model", str(model), "--reference", args.validator,
                                            "--kv-profile", profile, *ctx_flag, *nats_args]))
        envs["validator"] = {**env, **bus_env(creds.for_role("validator"))}
    gateway = Child("gateway", [*exe, "gateway", "--host", args.host, "--port", str(args.port),
                                "--model", str(model), *gateway_flags(args), *nats_args])
    children.append(gateway)
    keys, generated = gateway_keys(args.host, list(keys_from_env(args.api_key, args.api_key_file)))
    # not on the command line: ps shows that
    envs[gateway.name] = {**env, **bus_env(creds.gateway), API_KEYS_ENV: ",".join(keys)}
    return MeshPlan(children, envs, node_urls, keys, generated)


async def _start(plan: MeshPlan, base: str, stop: asyncio.Event, *, verbose: bool) -> None:
    """Start every child, wait for each node and then for the gateway (at `base`) to see a full route."""
    for c in plan.children:
        await c.start(plan.envs[c.name], verbose=verbose)
        print(f"[up] started {c.name} (pid {c.proc.pid})", flush=True)
    for node_id, url in ((i, u) for urls in plan.node_urls.values() for i, u in urls.items()):
        print(f"[up] loading {node_id} …", flush=True)
        await _wait_ready(f"{url}/healthz", plan.children, node_id, 300, stop)
        print(f"[up] {node_id} serving at {url}", flush=True)
    print("[up] waiting for the gateway to see a full route …", flush=True)
    await _wait_ready(f"{base}/healthz", plan.children, "gateway", 120, stop)


def idle_draft_model(backend: str, profile: str) -> str:
    """Why a draft model on nodes of this backend and KV profile would never draft ("" when it
    would): routes speculate only over exact llama.cpp hops (gateway.generation.speculates)."""
    if backend == "llama" and profile == "exact":
        return ""
    runs = "the torch backend" if backend != "llama" else f"the {profile} KV profile"
    return (f"routes speculate only over --kv-profile exact llama.cpp nodes; these would run {runs}, "
            "so the draft model would never draft")


async def run(args: argparse.Namespace) -> int:
    """Start the mesh, wait for a full route, then idle until interrupted."""
    if args.draft_model is not None and not args.draft_model.is_file():
        print(f"meshnet up: error: --draft-model: no file {args.draft_model}", file=sys.stderr)
        return 2
    try:
        model, info, ranges = check_model(args.model, args.nodes, "torch" in (args.backend, args.validator))
    except (OSError, ValueError) as exc:  # no such file, not a GGUF, cut short, more nodes than layers, not splittable
        print(f"meshnet up: error: {exc}", file=sys.stderr)
        return 2
    n_layer = info.n_layer
    profile = args.kv_profile or usual_kv_profile(info.head_dim)  # the nodes' and the validator's
    if args.draft_model is not None and (why := idle_draft_model(args.backend, profile)):
        print(f"meshnet up: error: --draft-model: {why}", file=sys.stderr)
        return 2
    print(f"[up] model {model.name}: {n_layer} layers → {len(ranges)} shards of about equal compute {ranges}",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    with nats_store(REPO / ".cache" / "nats") as store:
        return await _run_mesh(args, model, ranges, profile, store, stop)


@contextlib.contextmanager
def nats_store(kept: Path) -> Iterator[Path]:
    """This run's JetStream store: `kept` (the Work Ledger, quarantines and routes outlive a
    restart), unless another running `meshnet up` holds it (two nats-servers on one store
    corrupt it): then a temporary one, removed when the run ends."""
    kept.mkdir(parents=True, exist_ok=True)
    with open(kept.parent / f".{kept.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with tempfile.TemporaryDirectory(prefix="meshnet-up-nats-") as tmp:
                print(f"[up] another meshnet up keeps its JetStream state in {kept}: this run keeps its own "
                      f"in {tmp} until it stops", flush=True)
                yield Path(tmp)
            return
        yield kept


async def _run_mesh(args: argparse.Namespace, model: Path, ranges: list[tuple[int, int]], profile: str,
                    store: Path, stop: asyncio.Event) -> int:
    """nats-server on `store`, then the tracker, nodes, gateway and validator, until `stop`."""
    conf = REPO / "nats.conf"
    port, monitor_port = _nats_ports(args.nats_port)
    # fresh users for this run: nobody knows them but the children they are handed to (a
    # restarted child gets its own again, from `envs`)
    ids = node_ids(len(ranges), args.replicas)
    creds = MeshCredentials.generate([i for group in ids for i in group])
    async with NatsServer.start(conf, port=port, monitor_port=monitor_port, store_dir=store,
                                users=creds) as nats:  # fmt: skip
        print(f"[up] nats-server ready at {nats.url} (config {nats.effective_config}: "
              f"{conf.name} with this run's users)", flush=True)
        run_file = run_file_path()
        write_run_file(run_file, RunInfo(url=nats.url, monitor_user=creds.monitor.user,
                                         monitor_password=creds.monitor.password, pid=os.getpid(),
                                         operator_user=creds.for_role("operator").user,
                                         operator_password=creds.for_role("operator").password))
        plan = _plan_children(args, model, ranges, ids, profile, creds, nats.url)
        children, envs, node_urls = plan.children, plan.envs, plan.node_urls
        try:
            base = f"http://{authority(args.host, args.port)}"
            await _start(plan, base, stop, verbose=not args.quiet)
            _banner(base, model_id(model), nats.url, plan.keys, plan.generated_keys, creds.monitor, run_file)
            return await _supervise(children, node_urls, nats, stop, envs, verbose=not args.quiet)
        except Interrupted as exc:
            print(f"[up] {exc}", flush=True)
            return 130
        except RuntimeError as exc:
            print(f"[up] error: {exc}", file=sys.stderr)
            return 1
        finally:
            print("[up] shutting down …", flush=True)
            for c in reversed(children):
                await c.stop()
            remove_run_file(run_file, os.getpid())
            print("[up] stopped", flush=True)


async def _supervise(children: list[Child], node_urls: dict[str, dict[str, str]], nats: NatsServer,
                     stop: asyncio.Event, envs: dict[str, dict[str, str]], *, verbose: bool) -> int:
    """Keep the mesh running until Ctrl-C: a crashed child is reported and started again after
    restart_delay, with the environment (so the bus logins) it first had; `node_urls` gives a
    composite node process's node ids and URLs; the end of nats-server ends the mesh (exit code 1)."""
    crashes: dict[str, list[float]] = {c.name: [] for c in children}
    pending: dict[asyncio.Task[None], Child] = {}  # restarts waiting out their back-off or readiness

    async def bring_back(c: Child, delay: float) -> None:
        try:
            await asyncio.wait_for(stop.wait(), delay)
            return  # stopping: stays down
        except TimeoutError:
            pass
        await c.restart(envs[c.name], verbose)
        assert c.proc is not None
        print(f"[up] {c.name} restarted (pid {c.proc.pid})", flush=True)
        for node_id, url in node_urls.get(c.name, {}).items():
            with contextlib.suppress(RuntimeError, Interrupted):
                await _wait_ready(f"{url}/healthz", [c], c.name, 300, stop)
                print(f"[up] {node_id} serving again at {url}", flush=True)

    try:
        while True:
            waiter = asyncio.create_task(stop.wait())
            nats_watch = asyncio.create_task(nats.wait())
            restarting = {id(c) for c in pending.values()}  # bring_back watches those until ready
            running = [c for c in children if c.exited() is None and c.proc is not None and id(c) not in restarting]
            watchers = {asyncio.create_task(c.proc.wait()): c for c in running}  # type: ignore[union-attr]
            done, _ = await asyncio.wait([waiter, nats_watch, *watchers, *pending],
                                         return_when=asyncio.FIRST_COMPLETED)
            for t in [waiter, nats_watch, *watchers]:
                t.cancel()
            # a child that died again while its restart waited for it to get ready is a crash too
            down = [pending.pop(t) for t in done & pending.keys()]
            down = [c for c in down if c.exited() is not None]
            down += [c for task, c in watchers.items() if task in done]
            if waiter in done:
                return 0
            if nats_watch in done:
                print("[up] nats-server exited: stopping the mesh", file=sys.stderr, flush=True)
                return 1
            for c in down:
                now = time.monotonic()
                recent = [t for t in crashes[c.name] if now - t < CRASH_WINDOW_S] + [now]
                crashes[c.name] = recent
                delay = restart_delay(len(recent))
                last = f": {c.lines[-1]}" if c.lines else ""
                code = c.exited()
                how = "stopped (SIGTERM or a clean exit)" if code in (0, -signal.SIGTERM) else f"exited with code {code}"
                print(f"[up] {c.name} {how}{last}; restarting in {delay:.0f} s "
                      f"(exit {len(recent)} in the last {CRASH_WINDOW_S:.0f} s)", file=sys.stderr, flush=True)
                restart = asyncio.create_task(bring_back(c, delay), name=f"restart-{c.name}")
                pending[restart] = c
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _composite_child(args: argparse.Namespace, model: Path, ranges: list[tuple[int, int]], group: list[str],
                     profile: str, creds: MeshCredentials, env: dict[str, str], nats_args: list[str],
                     ) -> tuple[Child, dict[str, str], dict[str, str]]:
    """The composite node process serving one replica (node ids `group`, one per range): the
    child, its node ids' URLs, and its environment (each shard's bus user, never argv)."""
    ports = [free_port() for _ in group]
    threads = process_threads(args.threads, args.replicas, os.cpu_count() or 1)
    argv = _node_argv(args, model, list(zip(ranges, group, ports, strict=True)), threads, profile)
    child = Child("+".join(group), [sys.executable, "-m", "meshnet.cli", *argv, *nats_args])
    urls = {node_id: f"http://127.0.0.1:{p}" for node_id, p in zip(group, ports, strict=True)}
    own = node_credentials_env({node_id: creds.for_role("node", node_id) for node_id in group})
    return child, urls, {**env, NODE_CREDENTIALS_ENV: own}


def _bytes(text: str) -> int:
    from nodes.main import parse_bytes

    return parse_bytes(text)


def _node_argv(args: argparse.Namespace, model: Path, shards: list[tuple[tuple[int, int], str, int]],
               threads: int | None, profile: str) -> list[str]:
    """`meshnet node`'s arguments for one composite node process of the mesh: each shard's
    range, node id and port (the bus's come after)."""
    argv = ["node", "--model", str(model), "--backend", args.backend]
    for (a, b), node_id, port in shards:
        argv += ["--layers", f"{a}:{b}", "--node-id", node_id, "--port", str(port)]
    if threads:
        argv += ["--threads", str(threads)]
    if args.ctx is not None:
        argv += ["--ctx", str(args.ctx)]
    if args.kv_memory is not None:
        argv += ["--kv-memory", str(args.kv_memory)]
    if args.draft_model is not None:  # the composite node gives it to its shard at layer 0
        argv += ["--draft-model", str(args.draft_model.resolve())]
    if args.backend == "llama":  # the torch reference has one profile
        argv += ["--kv-profile", profile]
    return argv


def split_problem(info: ModelInfo, n_ranges: int, torch: bool = False) -> str:
    """Why the model cannot be served as `n_ranges` shards, `torch`: also by the PyTorch
    reference (a node's or the validator's) ("" when it can) (pure)."""
    if n_ranges > 1 and not info.splittable:
        return f"{info.path.name} cannot be split into {n_ranges} shards: {info.reason}"
    if torch and (info.arch not in TORCH_ARCHS or info.expert_count):
        return (f"the PyTorch reference (--backend torch, --validator torch) implements dense "
                f"{', '.join(sorted(TORCH_ARCHS))} only, not {info.arch!r}" + (" with experts" if info.expert_count else ""))
    return ""


def check_model(model_arg: str | None, nodes: int, torch: bool = False) -> tuple[Path, ModelInfo, list[tuple[int, int]]]:
    """The GGUF, what its header says and its layer ranges, checked before anything starts: a
    missing file, one that is no GGUF or is cut short, or an architecture that cannot be cut
    raises OSError or ValueError here, not in each node after the mesh half started."""
    from artifacts.bundled import resolve_model
    from artifacts.source import GGUFFile

    model = resolve_model(model_arg)
    GGUFFile(model).check_complete()
    info = _model_info(model)
    ranges = _layout(model, nodes)
    problem = split_problem(info, len(ranges), torch)
    if problem:
        raise ValueError(problem)
    return model, info, ranges


def _layout(model: Path, nodes: int) -> list[tuple[int, int]]:
    from artifacts.gguf_header import read_header
    from artifacts.layout import shard_layout

    return shard_layout(read_header(model), nodes)


def _model_info(model: Path) -> ModelInfo:
    from artifacts.shard_file import read_model_info

    return read_model_info(model)


def _banner(base: str, model: str, nats_url: str, keys: list[str], generated: bool, monitor: Credential,
            run_file: Path) -> None:
    """What `meshnet up` serves and how to call it; `model` is the id the nodes announce, the
    one /v1/models lists (a user's GGUF is not the bundled model's name)."""
    if not keys:
        access = "open: no API key (loopback only; --api-key KEY to require one)"
        auth = ""
    else:
        access = (f"API key (generated for this run): {keys[0]}" if generated
                  else f"API key required ({len(keys)} given with --api-key, --api-key-file or MESHNET_API_KEYS)")
        auth = f" -H 'authorization: Bearer {keys[0] if generated else 'KEY'}'"
    print(
        f"""
[up] Meshnet is up.
  OpenAI API      {base}/v1   (model: {model})
  access          {access}
  telemetry       {base}/v1/telemetry   and {base}/v1/sessions/<id>/events
  metrics         {base}/metrics
  NATS            {nats_url}   (users generated for this run; the monitor's login is in {run_file})
  watch it        meshnet watch
                  nats sub --user {monitor.user} --password {monitor.password} -s {nats_url} 'mesh.>'

  try:
    curl -s {base}/v1/chat/completions -H 'content-type: application/json'{auth} \\
      -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Say hi"}}]}}'

  Ctrl-C stops everything.
""",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of `meshnet up`."""
    args = _parse(list(argv or []))
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130
