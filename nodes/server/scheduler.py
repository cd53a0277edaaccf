"""HopScheduler: the one loop per shard engine that runs every session's pending rows as one batch.

    frames in -> HopSession (per-session inbox, checks) -> HopScheduler.submit(Work)
      -> each iteration: plan_batch picks rows of many sessions under a row budget
      -> one engine.forward_batch call (one llama.cpp batch, one sequence id per session)
      -> each Work's `done` gets its output -> the session hands it to its next hop / samples

The plan is a pure function over plain data (table-tested without a model): every session
with a decode row gets it into the batch, and prefill rows fill what the budget leaves, so a
long prompt is cut into slices that never hold other sessions' decode steps for more than
one iteration. At most one Work per session runs per iteration, oldest first, so a session's
rows run in order.

Iterations run as event-loop callbacks, not as a task: a Work submitted while I/O callbacks
are being handled joins the batch of the next iteration, which starts after the loop has
handled every socket that was ready (rows that arrived together run together). With the
"thread" engine placement the engine call runs on the engine's thread and the loop stays free.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from nodes.engine import BatchPart, EngineError, ShardOutput
from nodes.server.decode_pipeline import PipelineGauge
from nodes.server.engine_turns import EngineTurns, turn_wait
from nodes.server.runner import EngineRunner

log = logging.getLogger("meshnet.node.scheduler")

MAX_BATCH_ROWS = 512  # rows of one iteration (the engine's llama.cpp batch size)
MIXED_PREFILL_ROWS = 64  # prefill rows in an iteration that also carries decode rows
PREFILL_SLICE_S = 0.5  # an iteration of prefill rows only takes about this long at most
MIXED_SLICE_S = 0.05  # while sessions decode here, a prompt already in its slices takes about this long of rows
# (64 rows near a prompt's start cost less: short prompts keep MIXED_PREFILL_ROWS; 9k rows deep 4 rows cost ~0.1 s)
MIN_MIXED_ROWS = 4  # ...and at least this many
PRICED_SESSIONS = 256  # sessions whose latest cost per prefill row a hop keeps
MIN_SLICE_ROWS = 16
UNMEASURED_SLICE_ROWS = 64
LONG_SHARE = 4  # beside short prompts a long one keeps 1/LONG_SHARE of the prefill rows
STEPWISE_ROW_COST = 8  # prefill rows of budget that one stepwise row (a model call of its own) stands for
REBUILD_HOLD_S = 1.0  # while a restart's rebuild waits, other rows wait up to this
LONG_CALL_S = 0.1  # inline: a model call this long or longer is followed by a breather
BREATHER_S = 0.005  # ...during which the event loop runs free (no engine call of any shard)

WorkOutcome = tuple[ShardOutput, float, int] | Exception  # (output, seconds in the model, cache bytes)
WorkDone = Callable[[WorkOutcome], None]  # sync: called once, from the iteration that finished the Work


@dataclass(slots=True)
class Work:
    """Rows of one session waiting for the engine: a prefill chunk or a decode step."""

    session_id: str
    position: int
    rows: np.ndarray
    done: WorkDone
    sample: bool = True  # tail: sample a token after the last row
    stepwise: bool = False  # every row its own model call (a restart's replay of decoded tokens)
    rebuild: bool = False  # a restart's prefill of a stream's history (its client waits for it)
    drafts: Sequence[int] | None = None  # a verify step (BatchPart.drafts): its rows run in one iteration
    rewind: bool = False  # BatchPart.rewind
    offset: int = 0  # rows already run
    reused: int = 0  # rows of those the engine took from a shared prefix instead of computing
    pieces: list[np.ndarray] = field(default_factory=list)  # hidden rows of the slices run so far
    seconds: float = 0.0
    cancelled: bool = False
    submitted: float = field(default_factory=time.monotonic)

    @property
    def remaining(self) -> int:
        return len(self.rows) - self.offset


@dataclass(frozen=True, slots=True)
class PendingView:
    """What plan_batch sees of one Work."""

    session_id: str
    remaining: int
    stepwise: bool = False
    rebuild: bool = False
    waited_s: float = 0.0  # since the Work was submitted
    whole: bool = False  # a verify step: all its rows in one iteration, planned with the decode rows
    mixed_rows: int | None = None  # beside decode rows at most this many (mixed_rows: its time bound); None: no bound


def plan_batch(pending: Sequence[PendingView], *, max_rows: int, prefill_rows: int,
               mixed_prefill_rows: int, hold_s: float = 0.0, max_decode: int | None = None,
               decoding: bool = False) -> list[tuple[int, int]]:
    """Which Works run in this iteration and how many of their rows: (index, rows) pairs.

    Works are in arrival order. Only a session's oldest Work is eligible. Every eligible
    decode row (a Work with one row left, or a verify step's rows: `whole`) goes in first, up
    to `max_rows` and, oldest first, `max_decode` sessions (a pipelining hop's group:
    nodes/server/decode_pipeline.py); prefill rows then fill the rest: at most
    `mixed_prefill_rows` of them when the batch carries decode rows, else at most
    `prefill_rows`. Prompts whose rows fit that bound go first, oldest first (a short request
    is not held behind a long prompt's slices), then the longer ones, oldest first, which keep
    a quarter of the bound beside short ones that came after them (_prefill_rows), so neither
    starves. A batch with room always takes some prefill rows, so no prompt starves behind
    decode steps. While sessions decode through the hop (the batch carries decode rows, or
    `decoding`: their rows are on their way) a prompt that is no rebuild takes at most its
    `mixed_rows` (mixed_rows: about 50 ms of rows at its latest cost; None for a prompt's first
    slice, so a short prompt runs whole): deep in a long prompt 64 rows cost ~1.5 s, and each
    decode step waited behind them on every hop. Stepwise Works (a restart's
    replay) run beside the rest: each gets up to the budget / STEPWISE_ROW_COST rows, since
    each of its rows is a model call (the engine runs row w of every stepwise Work in one
    call, so their count does not lengthen the iteration).

    A restart's rebuild (`rebuild`: a stream whose client has had no token since its route
    lost a hop) is urgent: rebuilds take the prefill budget first, shortest first (by the
    rows of their current frame), so each recovers as early as it can, and with a rebuild
    waiting (batched or stepwise) an iteration with decode rows has the whole prefill budget
    for rebuilds, not the mixed one; other prompts beside decode rows keep the mixed bound.
    The decoding sessions wait one prefill slice, as they do behind any prefill-only
    iteration. With `hold_s`, they wait longer: while a rebuild's rows are queued, Works that
    are no rebuild stay out of the batch until they have waited `hold_s`. Each cut stream
    then gets its token one rebuild after another, not one rebuild and every recovered
    stream's decode steps after another; the first recovered streams take their next step
    once the rebuilds are done (the client had a token meanwhile). A rebuild that would
    leave no more than a quarter of the budget for a later iteration runs whole."""
    decode, prefill, rebuilding = _eligible(pending, hold_s)
    plan = _decode_rows(pending, decode, max_rows, max_decode)
    room = max_rows - sum(n for _, n in plan)
    others = min(room, mixed_prefill_rows if plan else prefill_rows)  # rows for prompts that are no rebuild
    budget = min(room, prefill_rows) if rebuilding else others
    return plan + _prefill_rows(pending, prefill, budget, others, room, mixed=bool(plan) or decoding)


def _prefill_rows(pending: Sequence[PendingView], prefill: list[int], budget: int, others: int,
                  room: int, *, mixed: bool = False) -> list[tuple[int, int]]:
    """plan_batch's prefill rows (pure): `budget` rows in all, `others` of them for prompts that
    are no rebuild, `room` rows left in the batch. Among the prompts that are no rebuild those
    whose rows fit `others` go first, oldest first (short_first), then the longer ones, oldest
    first; the short ones that came after the oldest longer one leave it 1/LONG_SHARE of the
    rows the rebuilds leave them, so a stream of short prompts never starves it (the ones that
    came before it take their rows as oldest first would give them). Beside decode rows
    (`mixed`) a prompt that is no rebuild takes at most its `mixed_rows`."""
    plan: list[tuple[int, int]] = []
    prefill, short, oldest_long = short_first(pending, prefill, min(budget, others))
    share: int | None = None  # the longer prompt's rows, once the rebuilds have theirs
    rebuild_slack = budget // 4
    waves = max(1, budget // STEPWISE_ROW_COST)
    for i in prefill:
        if pending[i].stepwise:
            plan.append((i, min(waves, pending[i].remaining)))
            room -= plan[-1][1]
            continue
        if share is None and not pending[i].rebuild:
            share = min(budget, others) // LONG_SHARE if oldest_long is not None else 0
        after = i in short and oldest_long is not None and i > oldest_long
        allowed = budget if pending[i].rebuild else min(budget, others) - ((share or 0) if after else 0)
        if mixed and not pending[i].rebuild and pending[i].mixed_rows is not None:
            allowed = min(allowed, pending[i].mixed_rows)
        if allowed <= 0:
            continue
        if (pending[i].rebuild and pending[i].remaining <= allowed + rebuild_slack
                and pending[i].remaining <= room):
            allowed = pending[i].remaining  # a few rows left over would cost the stream a whole iteration
        n = prefill_slice(pending[i].remaining, allowed)
        plan.append((i, n))
        budget -= n
        room -= n
        if not pending[i].rebuild:
            others -= n
    return plan


def short_first(pending: Sequence[PendingView], prefill: list[int],
                fits: int) -> tuple[list[int], set[int], int | None]:
    """`prefill` with the prompts that are no rebuild and no replay reordered (pure): those with
    `fits` rows or fewer left (short) before the longer ones, oldest first in each group; every
    other Work keeps its place. Returns the order, the short ones and the oldest longer one."""
    movable = [i for i in prefill if not (pending[i].rebuild or pending[i].stepwise)]
    short = [i for i in movable if pending[i].remaining <= fits]
    longer = [i for i in movable if pending[i].remaining > fits]
    order = iter(short + longer)
    moved = set(movable)
    return [next(order) if i in moved else i for i in prefill], set(short), min(longer, default=None)


def _decode_rows(pending: Sequence[PendingView], decode: list[int], max_rows: int,
                 max_decode: int | None) -> list[tuple[int, int]]:
    """plan_batch's decode rows (pure): in order, up to `max_rows` rows and `max_decode` steps
    that are no rebuild (a rebuild's last row is urgent, never held for a group)."""
    plan: list[tuple[int, int]] = []
    rows = steps = 0
    for i in decode:
        n = pending[i].remaining
        if rows + n > max_rows and plan:
            continue
        if not pending[i].rebuild:
            if max_decode is not None and steps >= max_decode:
                continue
            steps += 1
        plan.append((i, n))
        rows += n
    return plan


def _eligible(pending: Sequence[PendingView], hold_s: float) -> tuple[list[int], list[int], bool]:
    """plan_batch's candidates (pure): each session's oldest Work, as decode rows (one row, or
    a verify step) and prefill Works, rebuilds first (shortest first), the others held back
    while a rebuild waits and they have not waited `hold_s`; and whether a rebuild waits."""
    seen: set[str] = set()
    decode: list[int] = []
    prefill: list[int] = []
    for i, w in enumerate(pending):
        if w.session_id in seen or w.remaining <= 0:
            continue
        seen.add(w.session_id)
        (decode if w.remaining == 1 or w.whole else prefill).append(i)
    rebuilding = any(pending[i].rebuild for i in prefill)
    if rebuilding and hold_s > 0:
        def runs_now(i: int) -> bool:
            return pending[i].rebuild or pending[i].waited_s >= hold_s

        decode = [i for i in decode if runs_now(i)]
        prefill = [i for i in prefill if runs_now(i)]
    if rebuilding:
        urgent = sorted((i for i in prefill if pending[i].rebuild and not pending[i].stepwise),
                        key=lambda i: pending[i].remaining)
        first = set(urgent)
        prefill = urgent + [i for i in prefill if i not in first]
    return decode, prefill, rebuilding


def prefill_slice(remaining: int, budget: int) -> int:
    """Rows of a prefill Work to run now, about `budget` at most (pure), never leaving a single
    row: the last row of a prompt is the one sampled, and llama.cpp gives a row computed in a
    call of its own other logits (up to ~0.6 apart here) than the same row at the end of a
    chunk, which is how every other engine (and llama.cpp's own prefill) computes it. The
    rows before it may be cut anywhere: their KV comes out the same (docs/shard-runtime.md)."""
    if remaining <= budget:
        return remaining
    n = max(1, budget)
    if remaining - n == 1:
        n = n - 1 if n > 1 else remaining
    return n


def mixed_rows(row_s: float, mixed_s: float = MIXED_SLICE_S, least: int = MIN_MIXED_ROWS) -> int | None:
    """Rows a prompt already in its slices takes beside decode rows (pure): about `mixed_s` of
    them at `row_s`, its latest cost per row (deep in a long prompt a row costs many times what
    it does near the start: it attends to every row before it), at least `least`. None when
    not priced yet (a prompt's first slice: a short prompt runs whole, under the mixed bound)."""
    if row_s <= 0:
        return None
    return max(least, int(mixed_s / row_s))


def _decode_step(work: Work) -> bool:
    """A decode step (one row, or a verify step's rows), not a prompt's chunk or a replay."""
    return not work.stepwise and (len(work.rows) == 1 or work.drafts is not None)


def slice_rows(prefill_tps: float, slice_s: float) -> int:
    """Prefill rows an engine doing `prefill_tps` tokens/s runs in about `slice_s` (at least 16)."""
    if prefill_tps <= 0:
        return UNMEASURED_SLICE_ROWS
    return max(MIN_SLICE_ROWS, int(prefill_tps * slice_s))


def breather_wait(last_call_s: float, since_end_s: float, *, long_s: float = LONG_CALL_S,
                  breather_s: float = BREATHER_S) -> float:
    """Seconds an inline engine call waits so the event loop runs free after the last one (pure).

    An inline call holds the loop, and asyncio runs at most one ready iteration per shard per
    turn of the loop, but reading a directive or making a connection takes several turns. So
    behind back-to-back prefill slices (0.5 s each, two shards on a composite node) an open
    directive was read 3-8 s late and a connect to the node timed out after 2 s (the gateway
    then reported the node lost and the new request failed).
    After a call of `long_s` or longer the next call of any shard on that loop waits until
    `breather_s` has passed since it ended: every turn in between handles I/O only."""
    if last_call_s < long_s:
        return 0.0
    return max(0.0, breather_s - since_end_s)


@dataclass
class _LoopCalls:
    """The last inline engine call on one event loop (every shard of a composite node's)."""

    seconds: float = 0.0
    ended: float = 0.0


_LOOP_CALLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopCalls] = weakref.WeakKeyDictionary()


class HopScheduler:
    """Owns the queue of Works of one engine and runs one batch per iteration."""

    def __init__(self, runner: EngineRunner, *, max_rows: int = MAX_BATCH_ROWS,
                 mixed_prefill_rows: int = MIXED_PREFILL_ROWS, slice_s: float | None = PREFILL_SLICE_S,
                 expected: Callable[[], int] | None = None, hold_s: float = REBUILD_HOLD_S,
                 turns: EngineTurns | None = None, breather_s: float = BREATHER_S,
                 mixed_slice_s: float | None = MIXED_SLICE_S) -> None:
        self.runner = runner
        self.breather_s = breather_s  # inline: the loop runs free this long after a long call
        self.hold_s = hold_s  # rows that are no rebuild wait up to this while a rebuild is queued
        self.expected = expected  # how many sessions on this hop are decoding (their rows come back here)
        self._turns = turns  # a composite node's shards, taking turns on one engine thread
        self._turn = turns.join(self._oldest, self._wake) if turns is not None else 0
        self.max_rows = max_rows
        self.mixed_prefill_rows = mixed_prefill_rows
        self.slice_s = slice_s  # None: prefill iterations are bounded by max_rows only
        self.mixed_slice_s = mixed_slice_s  # None: prompts beside decode rows take `mixed_prefill_rows`
        self._row_s: OrderedDict[str, float] = OrderedDict()  # session -> its latest cost per prefill row
        self.queue: list[Work] = []
        self.iterations = 0
        self.batched_rows = 0  # rows run in iterations that carried more than one session
        self.max_sessions_in_batch = 0
        self.max_iteration_s = 0.0  # the longest engine call of one iteration
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None  # a wait for rows on their way, cut short when they are in
        self._running = False  # an iteration's engine call is in flight (thread placement)
        self._iterating = False  # inside _iterate: a Work submitted from a callback waits for the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reported_tps = runner.engine.capability().prefill_tokens_per_second  # until measured here
        self.pipeline = PipelineGauge()  # decode groups on cores of its own (decode_pipeline.py)

    def decoding(self) -> int:
        """How many sessions decode through this hop now (1 when nobody says)."""
        return max(1, self.expected()) if self.expected is not None else 1

    def _decode_cap(self) -> int | None:
        """Decoding sessions per iteration when this hop pipelines them in groups (cores of its
        own, and the gauge says so); None: all of them."""
        if self.expected is None or self._turns is not None:  # shared cores: the shards take turns anyway
            return None
        sessions = self.decoding()
        cap = self.pipeline.per_iteration(sessions)
        return cap if cap < sessions else None

    def _per_iteration(self) -> int:
        """Decoding sessions whose rows an iteration waits for."""
        cap = self._decode_cap()
        return self.decoding() if cap is None else cap

    def submit(self, work: Work) -> None:
        """Queue `work`; its `done` is called once, with its output or its error.

        When every decoding session of this hop has its rows in (always, with one session),
        the iteration runs at once, inside this call: nothing else could join its batch, so
        it saves a trip through the event loop. Otherwise it runs from the loop, and so does a
        rebuild's Work: the previous hop hands several cut streams on at once, and the frames
        already read join one batch instead of one model call each."""
        self.queue.append(work)
        self.pipeline.busy(work.submitted)
        if _decode_step(work):
            self.pipeline.back(work.session_id, work.submitted)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if (self.expected is not None and not (self._running or self._iterating) and not work.rebuild
                and (self._timer is not None or not self._scheduled)
                and self._pending_sessions() >= self._per_iteration()):
            if self._timer is not None:  # the rows it waited for are all in
                self._timer.cancel()
                self._timer = None
            self._iterate()
        else:
            self._kick()

    async def run(self, session_id: str, position: int, rows: np.ndarray, *, sample: bool = True,
                  stepwise: bool = False, rebuild: bool = False, drafts: Sequence[int] | None = None,
                  rewind: bool = False) -> tuple[ShardOutput, float, int]:
        """Submit rows and wait for them: (output, seconds in the model, the session's cache bytes)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[ShardOutput, float, int]] = loop.create_future()

        def done(outcome: WorkOutcome) -> None:
            if fut.done():
                return
            if isinstance(outcome, Exception):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

        work = Work(session_id, position, rows, done, sample, stepwise, rebuild, drafts, rewind)
        self.submit(work)
        try:
            return await fut
        finally:
            work.cancelled = not fut.done() or fut.cancelled()
            if work.cancelled and work.rebuild:
                self._kick()  # an iteration drops it, and the rows held back for it go

    def _pending_sessions(self) -> int:
        queue = self.queue
        return 1 if len(queue) == 1 else len({w.session_id for w in queue})

    def _kick(self) -> None:
        if self._scheduled or self._running or not self.queue:
            return
        self._scheduled = True
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._loop.call_soon(self._iterate)

    def prefill_rows(self) -> int:
        """Prefill rows of an iteration without decode rows: about `slice_s` of prefill work."""
        if self.slice_s is None:
            return self.max_rows
        rate = self.runner.meter.prefill_tps or self._reported_tps
        return min(self.max_rows, slice_rows(rate, self.slice_s))

    def _mixed_rows(self, work: Work) -> int | None:
        """`work`'s rows beside decode rows, from its session's latest slices (mixed_rows)."""
        if self.mixed_slice_s is None:
            return None
        return mixed_rows(self._row_s.get(work.session_id, 0.0), self.mixed_slice_s)

    def _price_rows(self, works: list[Work], parts: list[BatchPart], seconds: float) -> None:
        """Note each prompt's cost per row from an iteration that ran its rows: the iteration's
        time over its prefill rows (replays aside: each of their rows is a model call)."""
        prompts = [(w, p) for w, p in zip(works, parts, strict=True) if not _decode_step(w)]
        if seconds <= 0 or not prompts or any(w.stepwise for w in works):
            return
        row_s = seconds / sum(len(p.rows) for _, p in prompts)
        for w, _ in prompts:
            self._row_s[w.session_id] = row_s
            self._row_s.move_to_end(w.session_id)
        while len(self._row_s) > PRICED_SESSIONS:
            self._row_s.popitem(last=False)

    def _iterate(self) -> None:
        self._iterating = True
        try:
            self._iterate_once()
        finally:
            self._iterating = False

    def _iterate_once(self) -> None:
        self._scheduled = False
        self._timer = None
        if any(w.cancelled for w in self.queue):
            self.queue = [w for w in self.queue if not w.cancelled]
            if self._turns is not None:
                self._turns.wake_others(self._turn)  # a shard that gave way to them looks again
        if self._running or not self.queue:
            return
        wait = self._turn_wait() or self._breather()
        if wait > 0:  # rows on their way, another shard goes first (its call's end wakes this one), or the loop breathes
            self._scheduled = True
            assert self._loop is not None
            self._timer = self._loop.call_later(wait, self._iterate)
            return
        self._run_iteration()

    def _wake(self) -> None:
        """Look at the queue again now (EngineTurns: another shard's call ended): a wait for
        rows or for that shard is cut short."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._scheduled = False
        self._kick()

    def _turn_wait(self) -> float:
        """A composite node's shard: wait for decoding sessions' rows still on their way
        (engine_turns.py); 0 elsewhere, and for a restart's rebuild, which never waits."""
        turns = self._turns
        if turns is None or self.expected is None or any(w.rebuild for w in self.queue):
            return 0.0
        now = time.monotonic()
        return turn_wait(self._pending_sessions(), self.expected(), now - self.queue[0].submitted,
                         turns.others_older(self._turn), turns.since_other_call(self._turn, now))

    def _breather(self) -> float:
        """Inline: seconds until the loop has run free long enough after a long call (breather_wait)."""
        if self.runner.placement != "inline" or self._loop is None:
            return 0.0
        last = _LOOP_CALLS.get(self._loop)
        if last is None:
            return 0.0
        return breather_wait(last.seconds, time.monotonic() - last.ended, breather_s=self.breather_s)

    def _oldest(self) -> float | None:
        """When the oldest queued row came (None: nothing queued)."""
        return min((w.submitted for w in self.queue if not w.cancelled), default=None)

    def _run_iteration(self) -> None:
        now = time.monotonic()
        plan = plan_batch([PendingView(w.session_id, w.remaining, w.stepwise, w.rebuild, now - w.submitted,
                                       w.drafts is not None, self._mixed_rows(w)) for w in self.queue],
                          max_rows=self.max_rows, prefill_rows=self.prefill_rows(),
                          mixed_prefill_rows=self.mixed_prefill_rows, hold_s=self.hold_s,
                          max_decode=self._decode_cap(), decoding=self.expected is not None and self.expected() > 0)
        works = [self.queue[i] for i, _ in plan]
        for w in works:
            if _decode_step(w):
                self.pipeline.waited(now - w.submitted)
        parts = [BatchPart(w.session_id, w.position + w.offset, w.rows[w.offset:w.offset + n],
                           sample=w.sample and w.offset + n == len(w.rows), stepwise=w.stepwise,
                           drafts=w.drafts, rewind=w.rewind)
                 for w, (_, n) in zip(works, plan, strict=True)]
        if self.runner.placement == "thread":
            self._running = True
            task = asyncio.ensure_future(self.runner.forward_batch(parts))
            task.add_done_callback(lambda t: self._threaded_done(t, works, parts))
            return
        try:
            results, seconds = self.runner.forward_batch_now(parts)
        except Exception as exc:  # the engine call itself broke: every Work in it fails, the loop goes on
            log.exception("a batch of %d part(s) failed", len(parts))
            results, seconds = [exc] * len(parts), 0.0
        if self._loop is not None:
            _LOOP_CALLS[self._loop] = _LoopCalls(seconds, time.monotonic())
        self._complete(works, parts, results, seconds)

    def _threaded_done(self, task: asyncio.Future, works: list[Work], parts: list[BatchPart]) -> None:
        self._running = False
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            results, seconds = [exc if isinstance(exc, Exception) else EngineError(str(exc))] * len(parts), 0.0
        else:
            results, seconds = task.result()
        self._complete(works, parts, results, seconds)

    def _complete(self, works: list[Work], parts: list[BatchPart], results: Sequence[object],
                  seconds: float) -> None:
        self.iterations += 1
        if len(parts) > 1:
            self.batched_rows += sum(len(p.rows) for p in parts)
        self.max_sessions_in_batch = max(self.max_sessions_in_batch, len(parts))
        self.max_iteration_s = max(self.max_iteration_s, seconds)
        self._price_rows(works, parts, seconds)  # the next slices of these prompts (mixed_rows)
        now = time.monotonic()
        if all(_decode_step(w) for w in works):
            self.pipeline.iteration(seconds, now, self.decoding())
        finished: list[tuple[Work, WorkOutcome]] = []
        for work, part, result in zip(works, parts, results, strict=True):
            work.seconds += seconds
            if isinstance(result, Exception):
                finished.append((work, result))
                continue
            assert isinstance(result, ShardOutput)
            work.offset += len(part.rows)
            work.reused += result.reused
            if result.hidden is not None:
                work.pieces.append(result.hidden)
            if work.remaining == 0:
                if _decode_step(work):
                    self.pipeline.left(work.session_id, now)
                finished.append((work, (self._joined(work, result), work.seconds, self._cache_bytes(work))))
        if finished:
            done = {id(w) for w, _ in finished}
            self.queue = [w for w in self.queue if id(w) not in done]
        if not self.queue:
            self.pipeline.idle(now)
        if self._turns is not None:
            self._turns.ended(self._turn)  # the other shards look again
        for work, outcome in finished:
            try:
                work.done(outcome)
            except Exception:  # a session's callback never stops the other sessions
                log.exception("session %s: a finished Work's callback failed", work.session_id)
        self._kick()

    @staticmethod
    def _joined(work: Work, last: ShardOutput) -> ShardOutput:
        if len(work.pieces) <= 1:
            last.reused = work.reused
            return last  # one slice, or a tail: the token (and logits) of the last slice
        return ShardOutput(hidden=np.concatenate(work.pieces), token=last.token, logits=last.logits,
                           reused=work.reused)

    def _cache_bytes(self, work: Work) -> int:
        try:
            return self.runner.engine.cache_bytes(work.session_id)
        except EngineError:
            return 0

    def stats(self) -> dict[str, object]:
        """JSON-ready counters of the scheduler."""
        return {"iterations": self.iterations, "queued": len(self.queue), "batched_rows": self.batched_rows,
                "max_sessions_in_batch": self.max_sessions_in_batch,
                "decode_groups": self.pipeline.groups, "most_decode_groups": self.pipeline.most_groups,
                "decode_away_ms": round(self.pipeline.away_s * 1e3, 1),
                "decode_iteration_ms": round(self.pipeline.iteration_s * 1e3, 1),
                "max_iteration_s": round(self.max_iteration_s, 3),
                "engine_busy_s": round(self.runner.meter.busy_s, 3)}

