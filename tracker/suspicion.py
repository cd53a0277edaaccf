"""Suspected nodes: how long a node reported lost stays out of new routes (pure).

A gateway that loses a hop mid-session reports it (an abort directive naming the node). The
node is out of new routes until it speaks again after the report: a restarted node is back at
its first announcement. But a node whose bus works while its activation port does not (a
firewall, a wrong --advertise, a frozen process whose heartbeat thread still beats) speaks again
at once, takes new routes, and fails them. So a node reported again after it came back is a
repeat offender: each such strike holds it out longer (HOLD_S), whatever it says meanwhile.
Reports while it is already out are the same loss seen by several sessions: no new strike.
Strikes are forgotten after STRIKE_MEMORY_S without a report.

A node is back at its second message read CONFIRM_S or more after its first since the report
(and the hold), or at once at a message of a newer process (a restart). Messages the node sent
before it died can reach the tracker after the report: a frozen or restarting nats-server holds
them and delivers them together with the report once it runs again. Taken for the node's word,
they brought a SIGKILLed node back into routes until it expired 3 s later.

Every time here is the tracker's own awake clock (tracker/awake.py: monotonic, so a step of its
wall clock, by NTP or a resumed VM, neither lengthens nor ends a hold): when it read the
report, when it read the node's message. The gateway's and the node's clocks are other machines' (a node whose clock is
90 s behind the gateway's stayed out of routes 90 s after its first loss, one 90 s ahead was never
held out at all).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

HOLD_S = (0.0, 10.0, 30.0, 120.0)  # the Nth strike keeps a node out at least this long (the last for any after)
STRIKE_MEMORY_S = 600.0  # a report this long after the previous one starts again at one strike
# a node's messages held by the bus arrive together; a live one's come a heartbeat (1 s) apart
CONFIRM_S = 0.5


@dataclass(frozen=True, slots=True)
class Suspicion:
    """The latest report that a node was lost."""

    reported_at: float  # when the tracker read the report (its awake clock)
    strikes: int  # reports after which the node had come back, within STRIKE_MEMORY_S of each other
    started_at: float = 0.0  # the reported process's (its announcement's started_at; 0: unknown)
    heard_at: float | None = None  # when the tracker read its first message after the report and hold

    @property
    def hold_s(self) -> float:
        return HOLD_S[min(self.strikes, len(HOLD_S)) - 1]


def reported(last: Suspicion | None, at: float, still_out: bool, started_at: float = 0.0) -> Suspicion:
    """The suspicion after a report at `at` of the process started at `started_at`, given the
    node's previous report (kept after it cleared) and whether that one still holds it out."""
    if last is None or at - last.reported_at >= STRIKE_MEMORY_S:
        return Suspicion(at, 1, started_at)
    if still_out:
        return Suspicion(max(at, last.reported_at), last.strikes, started_at)
    return Suspicion(at, last.strikes + 1, started_at)


def clears(s: Suspicion, sent_at: float) -> bool:
    """Whether a message of the node that the tracker read at `sent_at` brings it back."""
    return sent_at > s.reported_at + s.hold_s


def heard(s: Suspicion, at: float, started_at: float = 0.0) -> Suspicion | None:
    """The suspicion after a message of the node's process started at `started_at` (0: not
    given) that the tracker read at `at`: None once the node is back."""
    if not clears(s, at):
        return s
    if started_at and s.started_at and started_at > s.started_at:
        return None  # a new process: nothing it says was held from before the loss
    if s.heard_at is None:
        return replace(s, heard_at=at)
    return None if at - s.heard_at >= CONFIRM_S else s
