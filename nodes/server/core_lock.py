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

Every node with a lock holds a shared flock on a fourth file for its whole life; a node that
finds no other live node holding it is alone on the machine (`co_located`) and runs without
the lock and without holding back for anyone. A node that is stopped (SIGSTOP, a debugger)
counts as gone: the others read the holders of each file from /proc/locks, and a waiter
that finds the lock's holder stopped stops waiting (`acquire` returns False, the call runs
without the lock), so a frozen node never freezes its neighbours.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

CORE_LOCK_MODES = ("auto", "on", "off")
CALM_WAIT_S = 2.0  # a node's self-measurement waits at most this long for a neighbour's rebuild
CALM_POLL_S = 0.01
LEASE_CHECK_S = 0.25  # a node waiting this long for the lock looks whether its holder is stopped
PEERS_CHECK_S = 1.0  # how often a node looks again whether other live nodes share the machine


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


def flock_holders(locks_text: str, inode: int) -> list[int]:
    """The pid of each flock held on the file with `inode` (one per open file, so a pid may
    come twice), from the text of /proc/locks (pure); waiters (`->` lines) hold none."""
    pids: list[int] = []
    for line in locks_text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or "->" in fields[:2]:
            continue
        try:
            if int(fields[5].rsplit(":", 1)[1]) == inode:
                pids.append(int(fields[4]))
        except (IndexError, ValueError):
            continue
    return pids


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T or t in /proc/<pid>/stat) or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    state = stat[stat.rfind(b")") + 2:][:1]
    return state in (b"T", b"t", b"Z", b"X")


def holders(fd: int, *, held_here: bool = False) -> list[int] | None:
    """Pids of the flocks on `fd`'s file, but for the one `fd` itself holds (`held_here`);
    None when /proc/locks cannot be read (nothing to tell apart)."""
    try:
        with open("/proc/locks") as f:
            text = f.read()
    except OSError:
        return None
    pids = flock_holders(text, os.fstat(fd).st_ino)
    if held_here and os.getpid() in pids:
        pids.remove(os.getpid())
    return pids


def held_by_live(fd: int, *, held_here: bool = False) -> bool:
    """Whether a process that is not stopped holds a flock on `fd`'s file (but for `fd`'s own,
    `held_here`); True when /proc/locks cannot be read."""
    pids = holders(fd, held_here=held_here)
    return pids is None or not all(is_stopped(p) for p in pids)


def held_by_stopped(fd: int) -> bool:
    """Whether `fd`'s file is flocked, and only by stopped processes."""
    pids = holders(fd)
    return bool(pids) and all(is_stopped(p) for p in pids)


class CoreLock:
    """A blocking, machine-wide exclusive lock held around each model call."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_lock_path()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._wait_fd = os.open(self.path.with_name(self.path.name + ".waiting"), os.O_RDWR | os.O_CREAT, 0o600)
        self._urgent_fd = os.open(self.path.with_name(self.path.name + ".urgent"), os.O_RDWR | os.O_CREAT, 0o600)
        self._peers_fd = os.open(self.path.with_name(self.path.name + ".peers"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._peers_fd, fcntl.LOCK_SH)  # this node is on the machine (co_located)
        self._urgent = False  # this node holds the shared flock on the urgent file
        self._co_located = True
        self._peers_checked = -PEERS_CHECK_S
        self._mu = threading.Lock()
        self._wanted = False  # a caller waits in acquire for the grabber's flock
        self._grabbing = False  # the grabber thread waits in flock
        self._got = threading.Event()  # the grabber took the lock for a waiting caller
        self._request = threading.Event()
        self._grabber: threading.Thread | None = None
        self.waits = 0  # calls that found the lock held by another node
        self.broken = 0  # waits given up because the holder was stopped
        self._frozen = False  # the last wait found the holder stopped: the next looks at once

    def co_located(self) -> bool:
        """Whether another live node shares this machine's cores (looked up at most once per
        PEERS_CHECK_S): alone, a node takes no lock and holds nothing back."""
        now = time.monotonic()
        if now - self._peers_checked >= PEERS_CHECK_S and self._peers_fd >= 0:
            self._peers_checked = now
            self._co_located = held_by_live(self._peers_fd, held_here=True)
        return self._co_located

    def try_acquire(self, *, count: bool = True) -> bool:
        """Take the lock if no other node holds it; False (and nothing held) otherwise.
        `count`: a refusal counts in `waits` (a call that had to wait). While the grabber
        waits for it (after a wait given up), only the grabber takes it (same open file: a
        second flock would merge with its)."""
        if self._grabbing:
            self.waits += count
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.waits += count
            return False
        return True

    def acquire(self) -> bool:
        """Take the lock, waiting while another node holds it (seen by others_waiting): True.
        False, holding nothing, when its holder is stopped: the caller runs without it."""
        if self.try_acquire():
            self._frozen = False
            return True
        if self._frozen and held_by_stopped(self._fd):
            self.broken += 1
            return False  # still stopped: no wait each call
        self._frozen = False
        with self._mu:
            self._got.clear()
            self._wanted = True
            if not self._grabbing:
                self._grabbing = True
                if self._grabber is None:
                    self._grabber = threading.Thread(target=self._grab, name="core-lock-grab", daemon=True)
                    self._grabber.start()
                self._request.set()
        while not self._got.wait(LEASE_CHECK_S):  # asleep: no cycles taken from the holder
            if held_by_stopped(self._fd):
                with self._mu:
                    if not self._got.is_set():
                        self._wanted = False  # the grabber gives the lock back when it gets it
                        self.broken += 1
                        self._frozen = True
                        return False
                break
        with self._mu:
            self._wanted = False
            self._got.clear()
        return True

    def _grab(self) -> None:
        """The grabber thread: waits in flock for each request, hands the lock to the waiting
        caller, or gives it back if that caller went on without it meanwhile."""
        while True:
            self._request.wait()
            self._request.clear()
            fd, wait_fd = self._fd, self._wait_fd
            if fd < 0:
                return
            try:
                fcntl.flock(wait_fd, fcntl.LOCK_SH)
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                return  # closed
            with self._mu:
                if self._fd != fd:
                    return  # closed while waiting: the numbers may belong to other files now
                fcntl.flock(wait_fd, fcntl.LOCK_UN)
                if not self._wanted:
                    fcntl.flock(fd, fcntl.LOCK_UN)  # before try_acquire may flock the same file again
                self._grabbing = False
                if self._wanted:
                    self._got.set()

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
        if self._urgent or not _shared_by_others(self._urgent_fd):
            return False
        return held_by_live(self._urgent_fd)

    def close(self) -> None:
        """Release the file descriptors (and with them the lock, if held)."""
        if self._fd >= 0:
            fds = (self._fd, self._wait_fd, self._urgent_fd, self._peers_fd)
            self._fd = self._wait_fd = self._urgent_fd = self._peers_fd = -1
            self._urgent = False
            self._request.set()  # an idle grabber ends; one waiting in flock ends with the process
            for fd in fds:
                os.close(fd)


class CalmCoreLock:
    """The core lock for work that can wait (a node's self-measurement at start, a few rounds
    of the lock): taken once no other node has urgent work queued, the waits of all rounds
    together `max_wait_s` at most. A node started again after a kill then measures itself
    after the rebuilds of the streams the kill cut, not between them."""

    def __init__(self, lock: CoreLock, max_wait_s: float = CALM_WAIT_S) -> None:
        self.lock = lock
        self.max_wait_s = max_wait_s
        self._deadline: float | None = None  # set at the first use
        self._held = False

    def __enter__(self) -> CoreLock:
        if not self.lock.co_located():
            return self.lock
        if self._deadline is None:
            self._deadline = time.monotonic() + self.max_wait_s
        while time.monotonic() < self._deadline and self.lock.others_urgent():
            time.sleep(CALM_POLL_S)
        self._held = self.lock.acquire()
        return self.lock

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._held:
            self._held = False
            self.lock.release()
