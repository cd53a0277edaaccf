"""How `meshnet watch` picks its login: given credentials, else a running `meshnet up`'s run file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bus.runinfo import RunInfo, read_run_file, remove_run_file, write_run_file
from meshnet.watch import build_parser, monitor_settings

UP = RunInfo(url="nats://127.0.0.1:4333", monitor_user="monitor", monitor_password="fresh", pid=os.getpid())


def _args(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(list(argv))


def test_without_credentials_watch_uses_the_running_meshnet_up() -> None:
    s = monitor_settings(_args(), {}, UP)
    assert (s.url, s.user, s.password) == (UP.url, "monitor", "fresh")
    assert monitor_settings(_args("--nats", UP.url), {}, UP).password == "fresh"


def test_given_credentials_or_another_bus_win_over_the_run_file() -> None:
    assert monitor_settings(_args("--nats-user", "m2", "--nats-password", "p"), {}, UP).user == "m2"
    assert monitor_settings(_args(), {"MESHNET_NATS_USER": "m3"}, UP).user == "m3"
    other = monitor_settings(_args("--nats", "nats://elsewhere:4222"), {}, UP)
    assert (other.url, other.password) == ("nats://elsewhere:4222", "monitor-dev")
    assert monitor_settings(_args(), {}, None).password == "monitor-dev"  # no meshnet up: dev user


def test_the_run_file_is_private_and_ignored_once_its_run_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "meshnet-up.json"
    write_run_file(path, UP)
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_run_file(path) == UP
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    write_run_file(path, UP.model_copy(update={"pid": int(dead.stdout)}))
    assert read_run_file(path) is None  # a run that died left it behind
    remove_run_file(path, os.getpid())  # not ours: stays
    assert path.exists()
    remove_run_file(path, int(dead.stdout))
    assert not path.exists()
    assert read_run_file(path) is None


def test_unquarantine_goes_to_the_bus_the_environment_names_over_a_running_meshnet_up(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A user probe: with another `meshnet up` running, MESHNET_NATS_URL was ignored and the lift
    went to that mesh's tracker."""
    from tracker.main import build_unquarantine_parser, operator_settings

    up = RunInfo(url=UP.url, monitor_user="monitor", monitor_password="fresh", pid=os.getpid(),
                 operator_user="operator", operator_password="op-fresh")
    args = build_unquarantine_parser().parse_args(["node-x"])
    monkeypatch.delenv("MESHNET_NATS_URL", raising=False)
    monkeypatch.delenv("MESHNET_NATS_USER", raising=False)
    assert operator_settings(args, up).password == "op-fresh"
    monkeypatch.setenv("MESHNET_NATS_URL", "nats://127.0.0.1:4401")
    mine = operator_settings(args, up)
    assert (mine.url, mine.password) == ("nats://127.0.0.1:4401", "operator-dev")
    monkeypatch.setenv("MESHNET_NATS_URL", UP.url)  # that very bus: up's login
    assert operator_settings(args, up).password == "op-fresh"
