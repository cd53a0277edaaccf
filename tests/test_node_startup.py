"""A `meshnet node` that cannot start says why in one line and exits; one waiting for a NATS
server that is not up yet stops on a signal (a real nats-server, real node processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

from bus.server import NatsServer, free_port
from tests.fixtures.mesh import Mesh

ROOT = Path(__file__).resolve().parents[1]
GUARD_S = 120  # a guard against a hang, not a speed limit: each case ends in seconds


async def _node(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nodes.main", "--threads", "1", *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)


async def _ends(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    async with asyncio.timeout(GUARD_S):
        out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


async def test_a_wrong_nats_password_is_one_line_and_exit_2(nats_server: NatsServer, model_path: Path) -> None:
    user, _ = nats_server.credentials("node")
    code, out = await _ends(await _node("--model", str(model_path), "--layers", "0:15", "--nats", nats_server.url,
                                        "--nats-user", user, "--nats-password", "wrong"))
    assert code == 2 and "Authorization Violation" in out and "Traceback" not in out, out[-3000:]


async def test_a_model_that_does_not_exist_is_said_before_the_bus(tmp_path: Path) -> None:
    """Even with no NATS server to wait for, the missing file is said at once."""
    code, out = await _ends(await _node("--model", str(tmp_path / "none.gguf"), "--layers", "0:15",
                                        "--nats", f"nats://127.0.0.1:{free_port()}"))
    assert code == 2 and "none.gguf" in out and "not found" in out and "Traceback" not in out, out[-3000:]


async def test_a_file_that_is_no_gguf_or_is_cut_short_is_said_before_the_bus(tmp_path: Path, model_path: Path) -> None:
    """Such a file was found only once the node had joined the bus: with no NATS server yet the
    node waited for one, and said nothing about the file."""
    (tmp_path / "notes.gguf").write_text("not a model\n" * 50)
    with model_path.open("rb") as whole:
        (tmp_path / "cut.gguf").write_bytes(whole.read(4_000_000))
    for name, says in (("notes.gguf", "not a GGUF file"), ("cut.gguf", "truncated")):
        code, out = await _ends(await _node("--model", str(tmp_path / name), "--layers", "0:15",
                                            "--nats", f"nats://127.0.0.1:{free_port()}"))
        assert code == 2 and says in out and "nats error" not in out and "Traceback" not in out, out[-3000:]


async def test_a_context_beyond_the_kv_budget_is_refused_before_it_is_allocated(nats_server: NatsServer,
                                                                                model_path: Path) -> None:
    """`--ctx 1048576` (the flag's own maximum) made llama.cpp allocate one session of some
    12 GB on a 1 GiB `--kv-memory`: the node started, then the kernel's OOM killer ended it
    on its first calls (and `meshnet up` restarted it into the same end)."""
    user, password = nats_server.credentials("node")
    code, out = await _ends(await _node("--model", str(model_path), "--layers", "0:15", "--nats", nats_server.url,
                                        "--nats-user", user, "--nats-password", password, "--ctx", "1048576"))
    assert code == 2 and "--kv-memory" in out and "lower --ctx" in out and "Traceback" not in out, out[-3000:]


async def test_a_context_beyond_the_trained_one_is_warned_about(mesh: Mesh) -> None:
    """`meshnet up --ctx 16384` on SmolLM2 (trained on 8,192) said nothing, and /v1/models
    advertised 16,384 tokens whose second half the model was never trained on."""
    node = await mesh.spawn((0, 15), args=["--ctx", "16384"])
    assert any("WARNING" in line and "--ctx 16384 is beyond the 8192 tokens" in line for line in node.log), node.log


async def test_a_node_waiting_for_an_absent_nats_server_stops_on_sigterm(model_path: Path) -> None:
    proc = await _node("--model", str(model_path), "--layers", "0:15", "--nats", f"nats://127.0.0.1:{free_port()}")
    assert proc.stdout is not None
    async with asyncio.timeout(GUARD_S):
        while b"nats error during connect" not in (line := await proc.stdout.readline()):
            assert line, "the node exited instead of waiting for the server"
    os.kill(proc.pid, signal.SIGTERM)
    code, out = await _ends(proc)
    assert code == 0 and "stopped while waiting for the NATS server" in out and "Traceback" not in out, out[-3000:]


async def test_a_port_in_use_is_said_before_the_bus_and_the_model(model_path: Path) -> None:
    """Even with no NATS server to wait for (and before the model loads), the busy port is said at once."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, out = await _ends(await _node("--model", str(model_path), "--layers", "0:15", "--host", "127.0.0.1",
                                            "--port", str(port), "--nats", f"nats://127.0.0.1:{free_port()}"))
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in out and "Traceback" not in out, out[-3000:]
    assert "loading" not in out, out[-3000:]
