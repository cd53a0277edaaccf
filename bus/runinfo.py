"""The run file of a running `meshnet up`: where its bus is and the monitor's login.

`meshnet up` makes fresh bus users each run; it writes this small file (mode 0600) so that
`meshnet watch` on the same machine finds the monitor's credentials by itself. The file names
the pid that wrote it, so a file left behind by a run that died is ignored.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ValidationError

from bus.config import REPO_ROOT

RUN_FILE_ENV = "MESHNET_UP_FILE"
DEFAULT_RUN_FILE = REPO_ROOT / ".cache" / "meshnet-up.json"


class RunInfo(BaseModel):
    """What `meshnet up` tells monitors on this machine."""

    url: str
    monitor_user: str
    monitor_password: str
    pid: int  # the `meshnet up` process that wrote it
    # the operator's login (it may only ask trackers to lift a quarantine): `meshnet tracker
    # unquarantine` (empty: an older file)
    operator_user: str = ""
    operator_password: str = ""


def run_file_path(env: Mapping[str, str] | None = None) -> Path:
    """$MESHNET_UP_FILE, else .cache/meshnet-up.json under the repo root."""
    env = os.environ if env is None else env
    return Path(env[RUN_FILE_ENV]) if env.get(RUN_FILE_ENV) else DEFAULT_RUN_FILE


def write_run_file(path: Path, info: RunInfo) -> None:
    """Write `info` readable by this user only (written aside, then renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(info.model_dump_json(indent=2))
    os.replace(tmp, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive, but not our run
        return False
    return True


def read_run_file(path: Path) -> RunInfo | None:
    """The run file's contents if it exists, parses, and its `meshnet up` is still running."""
    try:
        info = RunInfo.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None
    return info if _alive(info.pid) else None


def remove_run_file(path: Path, pid: int) -> None:
    """Remove the run file if process `pid` wrote it (a newer run's file stays)."""
    with contextlib.suppress(OSError, ValidationError):
        if RunInfo.model_validate_json(path.read_bytes()).pid == pid:
            path.unlink()
