"""`meshnet up` as a user runs it: a real subprocess tree, a real chat request, Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from bus.config import DEV_CREDENTIALS
from bus.credentials import MeshCredentials
from bus.runinfo import RUN_FILE_ENV, RunInfo
from gateway.api_keys import API_KEYS_ENV
from meshnet.up import (
    _node_argv,
    _parse,
    _plan_children,
    composite_groups,
    free_port,
    idle_draft_model,
    nats_store,
    node_ids,
    process_threads,
    restart_delay,
    run,
)
from tests.fixtures.tiny_gguf import write_tiny_model


def test_a_port_for_a_child_comes_from_outside_the_ephemeral_range() -> None:
    """`meshnet up` picks its nodes' ports before they bind them: one from the kernel's
    ephemeral range could meanwhile become the local end of any outgoing connection."""
    from bus.server import PICKED_PORTS

    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert PICKED_PORTS[1] <= ephemeral_low
    for _ in range(20):
        port = free_port()
        assert PICKED_PORTS[0] <= port < PICKED_PORTS[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when picked


@pytest.mark.parametrize(("flag", "value"), [("--replicas", "0"), ("--nodes", "0"), ("--threads", "0"),
                                           ("--port", "70000"), ("--token-flush-ms", "5000"),
                                           ("--max-sessions", "0"), ("--queue-timeout", "-1"),
                                           ("--ctx", "8")])
def test_a_flag_out_of_range_is_a_usage_error_not_a_traceback(flag: str, value: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Checked as `meshnet up` parses them, not later by a process it started (or a traceback)."""
    with pytest.raises(SystemExit) as exc:
        _parse([flag, value])
    assert exc.value.code == 2 and f"{flag}: must be" in capsys.readouterr().err
    assert _parse(["--replicas", "2"]).replicas == 2


def test_kv_memory_goes_to_every_node_process() -> None:
    """A node refuses a --ctx whose one session does not fit its --kv-memory (the message says to
    raise it), which `meshnet up` could not pass on."""
    argv = _node_argv(_parse(["--ctx", "131072", "--kv-memory", "2G"]), Path("m.gguf"),
                      [((0, 15), "node-0", 7001), ((15, 30), "node-1", 7002)], None, "exact")
    assert argv[argv.index("--kv-memory") + 1] == str(2 << 30)
    assert "--kv-memory" not in _node_argv(_parse([]), Path("m.gguf"), [((0, 30), "node-0", 7001)], None, "exact")


def test_a_draft_model_goes_to_every_node_process_for_its_head_shard(tmp_path: Path) -> None:
    draft = tmp_path / "draft.gguf"
    argv = _node_argv(_parse(["--draft-model", str(draft)]), Path("m.gguf"),
                      [((0, 15), "node-0", 7001), ((15, 30), "node-1", 7002)], None, "exact")
    assert argv[argv.index("--draft-model") + 1] == str(draft)  # the composite node gives it to layer 0
    assert "--draft-model" not in _node_argv(_parse([]), Path("m.gguf"), [((0, 30), "node-0", 7001)], None, "exact")


def test_a_missing_draft_model_stops_meshnet_up_before_it_starts_anything(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["--draft-model", str(tmp_path / "absent.gguf"), "--nats-port", "0"])
    assert asyncio.run(run(args)) == 2
    assert "--draft-model: no file" in capsys.readouterr().err


def test_a_draft_model_that_would_never_draft_stops_meshnet_up_before_it_starts_anything(
        model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Routes speculate only over exact llama.cpp hops: a draft model elsewhere was loaded, logged
    "drafting with" and never drafted."""
    assert idle_draft_model("llama", "exact") == ""
    assert "the torch backend" in idle_draft_model("torch", "default")
    assert "the default KV profile" in idle_draft_model("llama", "default")
    args = _parse(["--kv-profile", "default", "--draft-model", str(model_path), "--model", str(model_path),
                   "--nats-port", "0", "--port", "0"])
    assert asyncio.run(run(args)) == 2
    err = capsys.readouterr().err
    assert "--draft-model:" in err and "--kv-profile exact" in err and "the default KV profile" in err, err


def test_each_replica_of_the_model_is_one_composite_node_process() -> None:
    assert composite_groups(node_ids(2, 1)) == [["node-0", "node-1"]]
    assert composite_groups(node_ids(3, 2)) == [["node-0-0", "node-1-0", "node-2-0"],
                                                ["node-0-1", "node-1-1", "node-2-1"]]
    # one process has every core (the node's default); replicas side by side share them out
    assert [process_threads(None, 1, 2), process_threads(None, 2, 2), process_threads(None, 4, 2)] == [None, 1, 1]
    assert [process_threads(None, 2, 8), process_threads(3, 2, 8)] == [4, 3]



@pytest.mark.parametrize("replicas", [1, 2])
def test_the_trackers_target_is_the_replicas_asked_for(replicas: int) -> None:
    # with the default target of 1, `--replicas 2` losing a node stayed "covered" (all green on
    # the console's Coverage Map) while each layer had half its replicas
    args = _parse(["--replicas", str(replicas), "--trackers", "2", "--validator", "off"])
    ids = node_ids(2, replicas)
    plan = _plan_children(args, Path("model.gguf"), [(0, 19), (19, 30)], ids, "default",
                          MeshCredentials.generate([i for group in ids for i in group]), "nats://127.0.0.1:4222")
    trackers = [c.argv for c in plan.children if c.name.startswith("tracker")]
    assert len(trackers) == 2
    for argv in trackers:
        assert argv[argv.index("--target-replicas") + 1] == str(replicas)

async def _wait_for_banner(proc: asyncio.subprocess.Process) -> list[str]:
    lines: list[str] = []
    assert proc.stdout is not None
    while raw := await proc.stdout.readline():
        lines.append(raw.decode().rstrip())
        if "Meshnet is up" in lines[-1]:
            return lines
    raise AssertionError("meshnet up exited before it was ready:\n" + "\n".join(lines[-40:]))


async def _interrupt(proc: asyncio.subprocess.Process) -> None:
    """Ctrl-C, as a user stops it: everything stops and the exit code is 0."""
    assert proc.stdout is not None
    if proc.returncode is None:
        proc.send_signal(signal.SIGINT)
    out = (await proc.stdout.read()).decode()
    await proc.wait()
    assert proc.returncode == 0, out[-2000:]
    assert "[up] stopped" in out


async def _watch_once(env: dict[str, str]) -> str:
    """`meshnet watch --once` with no credentials given: it must find them by itself."""
    watch = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshnet.cli", "watch", "--once", "--table-every", "3",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env)
    out, _ = await asyncio.wait_for(watch.communicate(), 60)
    assert watch.returncode == 0, out.decode()
    return out.decode()


async def test_meshnet_up_serves_a_chat_and_stops_cleanly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    run_file = tmp_path / "meshnet-up.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_NATS_")}
    # the gateway's key from the environment only: never on a command line (ps), never dropped
    env |= {"PYTHONUNBUFFERED": "1", RUN_FILE_ENV: str(run_file), API_KEYS_ENV: "sk-up-env-key"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshnet.cli", "up", "--nodes", "2", "--port", str(port),
        "--nats-port", "0", "--quiet", "--ctx", "3000",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    try:
        lines = await _wait_for_banner(proc)
        assert any("node-1 serving" in line for line in lines)
        banner = (await proc.stdout.readuntil(b"Ctrl-C")).decode()  # type: ignore[union-attr]
        assert "API key required (1 given" in banner, banner
        # this run's bus users: fresh passwords, the monitor's in a 0600 run file and the banner
        assert run_file.stat().st_mode & 0o777 == 0o600
        info = RunInfo.model_validate_json(run_file.read_bytes())
        assert info.pid == proc.pid and info.monitor_user == "monitor"
        assert info.monitor_password != DEV_CREDENTIALS["monitor"][1]
        assert f"nats sub --user monitor --password {info.monitor_password} -s {info.url} 'mesh.>'" in banner
        seen = await _watch_once(env)
        assert f"as monitor (from {run_file})" in seen, seen
        assert "node-0" in seen and "node-1" in seen and "routable" in seen, seen
        body = {"model": "smollm2-135m-instruct", "max_tokens": 8,
                "messages": [{"role": "user", "content": "Say hi"}]}
        async with aiohttp.ClientSession() as anonymous:
            async with anonymous.get(f"http://127.0.0.1:{port}/v1/models") as r:
                assert r.status == 401  # MESHNET_API_KEYS holds
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-up-env-key"}) as http:
            async with http.get(f"http://127.0.0.1:{port}/v1/models") as r:
                ids = [m["id"] for m in (await r.json())["data"]]
            assert ids == ["smollm2-135m-instruct"]
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                data = await r.json()
                assert r.headers["x-route-session-id"]
            # --ctx reached every node: the route's context is 3000 tokens, not the default 2048
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 json={**body, "max_tokens": 2990}) as r:
                refused = await r.json()
                assert r.status == 400 and refused["error"]["code"] == "context_length_exceeded", refused
                assert "maximum context length is 3000 tokens" in refused["error"]["message"], refused
        assert data["usage"]["completion_tokens"] >= 1
        assert data["choices"][0]["message"]["content"]
    finally:
        await _interrupt(proc)
    assert not run_file.exists()  # removed by the run that wrote it


def test_a_second_meshnet_up_keeps_its_jetstream_state_apart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two nats-servers on one store corrupt it (a user probe ran two `meshnet up` at once)."""
    kept = tmp_path / "nats"
    with nats_store(kept) as first:
        assert first == kept
        with nats_store(kept) as second:
            assert second != kept and second.is_dir()
        assert not second.exists()  # removed when that run ends
    with nats_store(kept) as again:  # the first run ended: the kept store is free again
        assert again == kept


def test_restart_back_off_doubles_and_is_capped() -> None:
    assert [restart_delay(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert restart_delay(20) == 30.0
    assert node_ids(2, 1) == [["node-0"], ["node-1"]]
    assert node_ids(2, 2) == [["node-0-0", "node-0-1"], ["node-1-0", "node-1-1"]]


async def test_a_node_killed_under_meshnet_up_is_restarted_and_its_stream_completes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_NATS_")}
    env |= {"PYTHONUNBUFFERED": "1", RUN_FILE_ENV: str(tmp_path / "meshnet-up.json")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshnet.cli", "up", "--nodes", "2", "--replicas", "2", "--port", str(port),
        "--nats-port", "0", "--quiet", "--api-key", "up-key",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    assert proc.stdout is not None
    try:
        lines = await _wait_for_banner(proc)
        # one composite node process per replica: node-0-r+node-1-r
        groups = dict(re.findall(r"\[up\] started (node-\S+) \(pid (\d+)\)", "\n".join(lines)))
        pids = {node_id: pid for name, pid in groups.items() for node_id in name.split("+")}
        assert len(groups) == 2 and len(pids) == 4, lines
        base = f"http://127.0.0.1:{port}"
        body = {"model": "smollm2-135m-instruct", "max_tokens": 80, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}]}
        banner = (await proc.stdout.readuntil(b"Ctrl-C")).decode()
        assert "API key required" in banner and "Bearer KEY" in banner, banner
        async with aiohttp.ClientSession() as anonymous:  # the gateway got the key from meshnet up
            async with anonymous.post(f"{base}/v1/chat/completions", json=body) as resp:
                assert resp.status == 401, await resp.text()
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer up-key"}) as http:
            got: list[str] = []
            async with http.post(f"{base}/v1/chat/completions", json=body,
                                 headers={"x-route-session-id": "up-restart"}) as resp:
                assert resp.status == 200
                async with http.get(f"{base}/v1/sessions/up-restart") as r:
                    victim = (await r.json())["route_nodes"][1]
                process = next(name for name in groups if victim in name.split("+"))
                killed = False
                async for raw in resp.content:
                    line = raw.decode()
                    if line.startswith("data: {"):
                        got.append(line)
                        if len(got) == 10 and not killed:
                            os.kill(int(pids[victim]), signal.SIGKILL)
                            killed = True
                    if line.startswith("data: [DONE]"):
                        break
            chunks = [json.loads(g[6:]) for g in got]
            assert killed and not [c for c in chunks if "error" in c], chunks[-3:]
            reasons = [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
            assert reasons == ["length"], chunks[-3:]  # all 80 tokens, across the restart
        seen: list[str] = []
        async with asyncio.timeout(300):
            while not any(f"{victim} serving again" in line for line in seen):
                raw = await proc.stdout.readline()
                assert raw, "meshnet up exited:\n" + "\n".join(seen[-20:])
                seen.append(raw.decode().rstrip())
        assert any(f"{process} exited with code -9" in line and "restarting in" in line for line in seen), seen
        assert any(f"{process} restarted (pid" in line for line in seen), seen
        # the restarted node is back on the bus: it got its own user again
        assert victim in await _watch_once(env)
    finally:
        await _interrupt(proc)


def _cut_short(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize(("make", "nodes", "says"), [
    (lambda d: d / "missing.gguf", 2, "not found"),
    (lambda d: (d / "notes.gguf").write_text("not a model\n" * 50) and d / "notes.gguf", 2, "not a GGUF file"),
    (lambda d: _cut_short(write_tiny_model(d / "cut.gguf", "llama")), 2, "truncated"),
    (lambda d: write_tiny_model(d / "m.gguf", "mamba"), 2, "'mamba' has no exact layer-range support"),
    (lambda d: write_tiny_model(d / "four.gguf", "llama", n_layer=4), 5, "--nodes must be between 1 and 4"),
])
def test_a_model_meshnet_up_cannot_serve_is_one_line_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], make, nodes: int, says: str) -> None:  # type: ignore[no-untyped-def]
    """A user's own GGUF that is missing, no GGUF, cut short or of an architecture that cannot be
    split was a traceback, or a mesh that started nats-server, the tracker, the validator and the
    gateway before its nodes failed; now one line names the problem and nothing starts."""
    from meshnet.up import main

    assert main(["--model", str(make(tmp_path)), "--nodes", str(nodes), "--quiet"]) == 2
    out = capsys.readouterr()
    assert says in out.err and "Traceback" not in out.err and out.err.startswith("meshnet up: error:")
    assert "[up] started" not in out.out and "nats-server" not in out.out


def test_the_banner_names_the_model_being_served(capsys: pytest.CaptureFixture[str]) -> None:
    """With `--model my-own.Q8_0.gguf` the banner said `model: smollm2-135m-instruct` and its
    example curl asked for that name, which the gateway answers with 404 model_not_found."""
    from artifacts.bundled import model_id
    from bus.credentials import Credential
    from meshnet.up import _banner

    _banner("http://127.0.0.1:8000", model_id("/m/My-Own.Q8_0.gguf"), "nats://127.0.0.1:4222", [], False,
            Credential(user="monitor", password="pw"), Path("/tmp/up.json"))
    out = capsys.readouterr().out
    assert "(model: my-own)" in out and '"model": "my-own"' in out and "smollm2" not in out


@pytest.mark.parametrize(("flags", "experts"), [(["--backend", "torch"], 0), (["--validator", "torch"], 4)])
def test_a_model_the_torch_reference_cannot_run_is_refused_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], experts: int) -> None:
    """`--backend torch` (or `--validator torch`) on a qwen2 GGUF, or a llama one with experts,
    started the whole mesh before each node (or the validator) refused the model."""
    from meshnet.up import main

    arch = "llama" if experts else "qwen2"
    path = write_tiny_model(tmp_path / "t.gguf", arch, n_expert=experts)
    assert main(["--model", str(path), "--quiet", *flags]) == 2
    out = capsys.readouterr()
    assert "implements dense llama only" in out.err and "[up] started" not in out.out
