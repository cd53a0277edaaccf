"""CoreLock across real processes: who shares the machine, and a stopped holder.

A second process (the real CoreLock in a child Python) holds the lock; SIGSTOP makes it a
frozen node. Its neighbours must see it as gone: not co-located, and a wait for the lock it
holds ends (acquire returns False) instead of lasting as long as the freeze."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodes.server.core_lock import CoreLock, flock_holders

HOLDER = """
import sys, time
from pathlib import Path
from nodes.server.core_lock import CoreLock
lock = CoreLock(Path(sys.argv[1]))
if sys.argv[2] == "hold":
    assert lock.acquire()
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def neighbour(tmp_path: Path) -> Iterator[callable]:  # type: ignore[valid-type]
    procs: list[subprocess.Popen[str]] = []

    def start(mode: str) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "cores.lock"), mode],
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return p

    yield start
    for p in procs:
        p.send_signal(signal.SIGCONT)
        p.kill()
        p.wait()


def stop(p: subprocess.Popen[str]) -> None:
    """SIGSTOP `p` and wait until it is stopped."""
    p.send_signal(signal.SIGSTOP)
    os.waitpid(p.pid, os.WUNTRACED)


def test_flock_holders_reads_proc_locks() -> None:
    text = ("1: FLOCK  ADVISORY  WRITE 4242 00:2e:77 0 EOF\n"
            "1: -> FLOCK  ADVISORY  WRITE 4343 00:2e:77 0 EOF\n"  # a waiter holds nothing
            "2: FLOCK  ADVISORY  READ 4444 00:2e:77 0 EOF\n"
            "3: POSIX  ADVISORY  WRITE 4545 00:2e:77 0 EOF\n"  # fcntl locks are not flocks
            "4: FLOCK  ADVISORY  WRITE 4646 00:2e:78 0 EOF\n")
    assert flock_holders(text, 77) == [4242, 4444]
    assert flock_holders(text, 78) == [4646]
    assert flock_holders("", 77) == []


def test_a_node_alone_is_not_co_located_and_a_stopped_one_does_not_count(tmp_path: Path, neighbour) -> None:  # type: ignore[no-untyped-def]
    lock = CoreLock(tmp_path / "cores.lock")
    try:
        assert not lock.co_located()
        other = neighbour("idle")
        lock._peers_checked = float("-inf")  # look again now
        assert lock.co_located()
        stop(other)
        lock._peers_checked = float("-inf")
        assert not lock.co_located()
    finally:
        lock.close()


def test_a_stopped_holder_does_not_keep_the_lock_from_its_neighbours(tmp_path: Path, neighbour) -> None:  # type: ignore[no-untyped-def]
    holder = neighbour("hold")
    lock = CoreLock(tmp_path / "cores.lock")
    try:
        assert not lock.try_acquire()
        stop(holder)
        assert lock.acquire() is False  # its holder is stopped: run without it
        assert lock.acquire() is False and lock.broken == 2  # still stopped
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait()
        assert lock.acquire() is True  # the holder's end released it
        lock.release()
    finally:
        lock.close()


def test_a_live_holder_is_waited_for(tmp_path: Path, neighbour) -> None:  # type: ignore[no-untyped-def]
    holder = neighbour("hold")
    lock = CoreLock(tmp_path / "cores.lock")
    try:
        timer = threading.Timer(0.6, holder.kill)  # longer than a lease check
        timer.start()
        assert lock.acquire() is True and lock.broken == 0
        lock.release()
        timer.join()
    finally:
        lock.close()
