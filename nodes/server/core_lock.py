"""CoreLock: one model call at a time on a machine whose cores several nodes share.

Each node's llama.cpp runs its graph on all the machine's cores with OpenMP barriers between
ops. With one session, co-located hops take turns by themselves (the tail waits for the
head's row); with many, the hop schedulers keep every hop busy, and two engines of N threads
each on N cores make every barrier wait for a thread the other process holds (measured in
docs/activation-protocol.md). The lock makes the co-located engines take turns instead (each
at full width); nodes on machines of their own never contend for it.
It is a flock(2) on a file in the temp directory, so it needs no coordinator and a killed
node releases it with its file descriptor. flock wakes waiters but does not queue them: a
holder that asks again right after its release wins. So a node waiting for the lock also
holds a shared flock on a second file, and a node that just made a long call gives the lock
up while any node is waiting (`others_waiting`, HopScheduler).
A node with a restart's rebuild queued (streams whose clients wait for their next token)
holds a shared flock on a third file (`set_urgent`); the others leave the cores to it while
they have only other work, for a bounded time (`others_urgent`, HopScheduler).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path
from types import TracebackType

CORE_LOCK_MODES = ("auto", "on", "off")
CALM_WAIT_S = 2.0  # a node's self-measurement waits at most this long for a neighbour's rebuild
CALM_POLL_S = 0.01


def default_lock_path() -> Path:
    """The lock file every node of this user on this machine shares."""
    return Path(tempfile.gettempdir()) / f"meshnet-cores-{os.getuid()}.lock"


def wants_core_lock(mode: str, n_threads: int, n_cores: int) -> bool:
    """Whether a node takes the lock: `on`, or `auto` when its engine uses every core (a node
    given fewer threads has its own share of the cores and runs alongside the others)."""
    if mode not in CORE_LOCK_MODES:
        raise ValueError(f"core lock mode must be one of {CORE_LOCK_MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and n_threads >= n_cores)


def _shared_by_others(fd: int) -> bool:
    """Whether another descriptor holds a flock on `fd`'s file (this one holds none)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


class CoreLock:
    """A blocking, machine-wide exclusive lock held around each model call."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_lock_path()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._wait_fd = os.open(self.path.with_name(self.path.name + ".waiting"), os.O_RDWR | os.O_CREAT, 0o600)
        self._urgent_fd = os.open(self.path.with_name(self.path.name + ".urgent"), os.O_RDWR | os.O_CREAT, 0o600)
        self._urgent = False  # this node holds the shared flock on the urgent file
        self.waits = 0  # calls that found the lock held by another node

    def try_acquire(self, *, count: bool = True) -> bool:
        """Take the lock if no other node holds it; False (and nothing held) otherwise.
        `count`: a refusal counts in `waits` (a call that had to wait)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.waits += count
            return False
        return True

    def acquire(self) -> None:
        """Take the lock, waiting as long as another node holds it (seen by others_waiting)."""
        if self.try_acquire():
            return
        fcntl.flock(self._wait_fd, fcntl.LOCK_SH)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        finally:
            fcntl.flock(self._wait_fd, fcntl.LOCK_UN)

    def others_waiting(self) -> bool:
        """Whether another node is waiting for the lock right now."""
        return _shared_by_others(self._wait_fd)

    def release(self) -> None:
        """Let the other nodes run."""
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def set_urgent(self, urgent: bool) -> None:
        """Say whether this node has urgent work queued (a restart's rebuild): while it does,
        the other nodes' `others_urgent` is True."""
        if urgent == self._urgent or self._urgent_fd < 0:
            return
        fcntl.flock(self._urgent_fd, fcntl.LOCK_SH if urgent else fcntl.LOCK_UN)
        self._urgent = urgent

    def others_urgent(self) -> bool:
        """Whether another node has urgent work queued right now (False while this one has:
        it then runs its own)."""
        return not self._urgent and _shared_by_others(self._urgent_fd)

    def __enter__(self) -> CoreLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def close(self) -> None:
        """Release the file descriptor (and with it the lock, if held)."""
        if self._fd >= 0:
            os.close(self._fd)
            os.close(self._wait_fd)
            os.close(self._urgent_fd)
            self._fd = self._wait_fd = self._urgent_fd = -1
            self._urgent = False


class CalmCoreLock:
    """The core lock for work that can wait (a node's self-measurement at start, a few rounds
    of the lock): taken once no other node has urgent work queued, the waits of all rounds
    together `max_wait_s` at most. A node started again after a kill then measures itself
    after the rebuilds of the streams the kill cut, not between them."""

    def __init__(self, lock: CoreLock, max_wait_s: float = CALM_WAIT_S) -> None:
        self.lock = lock
        self.max_wait_s = max_wait_s
        self._deadline: float | None = None  # set at the first use

    def __enter__(self) -> CoreLock:
        if self._deadline is None:
            self._deadline = time.monotonic() + self.max_wait_s
        while time.monotonic() < self._deadline and self.lock.others_urgent():
            time.sleep(CALM_POLL_S)
        return self.lock.__enter__()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.lock.__exit__(exc_type, exc, tb)
