"""HopSession: one Route Session on this hop: admission state, inbox, worker and forwarding."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from nodes.drafters import Drafter, PromptLookup
from nodes.engine import EngineError, ShardOutput
from nodes.server.admission import SessionView
from nodes.server.hop_evidence import EvidenceShelf, HopRecord
from nodes.server.hop_machine import (
    End,
    Event,
    HopLife,
    HopPhase,
    PromptIn,
    RunIn,
    RunOut,
    StreamIn,
    StreamOut,
    transition,
)
from nodes.server.return_stream import TokenReturn
from nodes.server.runner import EngineRunner
from nodes.server.scheduler import HopScheduler, Work, WorkOutcome
from nodes.server.seam_log import SeamLog
from nodes.speculation import DraftState, guess_holds, guess_pays
from schemas.credentials import hop_credential, unseal
from schemas.frames import (
    DEFAULT_VERIFY_DEPTH,
    SPEC_DEPTH,
    Compression,
    FrameHeader,
    FrameRejectedError,
    HopMark,
    HopUnreachableError,
    StepHeaders,
    WireDtype,
    WireResult,
    choose_compression,
    credit_limit,
    encode_rows,
    step_chunk,
    upstream_chunk,
    void_result,
    wire_result,
    wire_timing,
)
from schemas.route import DIRECT_RETURN_HOPS, RouteFailure, RouteSession, inbound_start
from wire.link import FrameLink, failure_from_rejection, failure_from_unreachable
from wire.seam_link import SeamLinks

log = logging.getLogger("meshnet.node.session")

FrameHook = Callable[["HopSession", FrameHeader], None]  # sync: runs on the frame path, must not block
# sync: answers a final frame where it finishes (None: a direct step past the head, whose token
# the tail sends straight to the head; the frame is done and nothing goes back)
ReplySink = Callable[[WireResult | RouteFailure | None], None]
RunEmit = Callable[[WireResult], bool]  # sync: streams one token of a Decode Run; False once the caller is gone


def run_continues(token_id: int, step: int, steps: int, stop_ids: frozenset[int], *, caller_gone: bool,
                  session_open: bool) -> bool:
    """Whether a Decode Run takes another step after step `step` (0-based) returned `token_id`
    (pure: the decision, apart from how the steps travel)."""
    return session_open and not caller_gone and token_id not in stop_ids and step < steps - 1


def claimed_decode_rows(decode_rows: int, decode_from: int, decode_end: int, used_rows: int | None) -> int:
    """The decode rows a hop claims in its NodeWork (pure): those at positions below
    `used_rows`, the rows its driver's answer used. A driver that leaves a Decode Run early (a
    stop string) counts only the tokens it kept, while the head went on until it noticed; the
    ledger refuses a claim above that count, so an honest hop claims no row the answer did not use.
    A hop computed every position from its first decode row (`decode_from`) up to the end of its
    last one (`decode_end`, a verify step's drafts included): a position whose draft was rejected
    was computed again with the kept token. So the claim is the positions in both ranges, whatever
    is still in flight when the close comes, and a last verify step's kept drafts count though no
    next step showed them (`decode_rows`, the rows booked, is the claim when no count was said)."""
    if used_rows is None or decode_from < 0:
        return decode_rows
    return max(0, min(decode_end, used_rows) - decode_from)


@dataclass(slots=True)
class HopConfig:
    """Per-node settings every HopSession shares."""

    node_id: str
    runner: EngineRunner  # opens and frees sessions' Hot KV State
    scheduler: HopScheduler  # runs every session's rows, batched across sessions
    hidden_size: int
    n_ctx: int
    window: int
    wire_dtype: WireDtype = "f32"
    compression: Compression = "none"
    test_delay_s: float = 0.0  # test-only: extra seconds per frame (MESHNET_TEST_DELAY_MS)
    frame_key: bytes = b""  # this node's frame key (schemas/credentials.py; given to the tracker)
    evidence: EvidenceShelf | None = None  # keeps each session's rows in and out for the validator
    drafter: Drafter = field(default_factory=PromptLookup)  # a head's drafted tokens (speculative decoding)
    seams: SeamLinks = field(default_factory=SeamLinks)  # one Seam Link per next-hop node, shared by its sessions
    verify_depth: int = DEFAULT_VERIFY_DEPTH  # a head's verify steps of one run in flight (1: no pipelining)


@dataclass(slots=True)
class SessionCounters:
    """Per-session wire and work counters, reported by GET /v1/sessions."""

    frames: int = 0
    rx_bytes: int = 0  # HTTP request bytes received: request line + headers + body
    rx_body_bytes: int = 0
    last_rx_bytes: int = 0
    decode_frames: int = 0
    decode_rx_bytes: int = 0
    tx_body_bytes: int = 0  # bodies forwarded to the next hop
    prefill_tokens: int = 0  # rows this hop computed (what its NodeWork books)
    shared_prefix_tokens: int = 0  # prefill rows it took from another session's KV instead (a shared prefix)
    decode_tokens: int = 0
    buffered: int = 0  # frames accepted and not yet handed on
    max_buffered: int = 0
    buffered_bytes: int = 0
    max_buffered_bytes: int = 0
    credit_waits: int = 0  # times this hop waited for the next hop's credit
    compute_s: float = 0.0
    drafted_tokens: int = 0  # tail: drafted tokens its verify steps checked
    accepted_tokens: int = 0  # tail: of those, the ones it kept
    guessed_steps: int = 0  # head: verify steps sent before the one before was answered (pipelined)
    voided_steps: int = 0  # tail: pipelined steps it voided unrun (the guess before them was wrong)


@dataclass(slots=True)
class Inbound:
    """An accepted frame waiting for the worker (a lane's step: its header is the
    stream's, `seq` and `position` the step's own)."""

    header: FrameHeader
    rows: np.ndarray
    nbytes: int
    arrived: float
    seq: int
    position: int
    reply: ReplySink | None = None  # final frames: called once, with the tail's result or the failure
    emit: RunEmit | None = None  # Decode Runs: called with every token before the reply
    error: Exception | None = None  # run at once and failed: the worker fails the session with it
    drafts: list[int] | None = None  # a verify step (speculative lane): rows 1.. are these drafted tokens
    guess: int = -1  # a pipelined step: the token the step before must end with (else the tail voids it)
    upstream: list[HopMark] | None = None  # a direct lane's step: the middle hops' timings before this hop


@dataclass(slots=True)
class _Verify:
    """A head's verify step of a speculative Decode Run, from drafting to its answer."""

    position: int
    token: int  # its first row: the token the step before ended with (or, pipelined, the guess)
    drafts: list[int]
    guess: int  # -1: sent after the step before was answered; else the token it guessed
    began: float  # drafting started
    proposed: float  # drafted: the model call starts
    arrived: float  # its first token was known (the handle time the head reports)
    seq: int = 0
    compute_s: float = 0.0  # this hop's model call
    result: WireResult | None = None  # a one-hop route: answered when sent


@dataclass(slots=True)
class HopSession:
    """One Route Session on this hop; the SessionTable owns it and its worker task."""

    route: RouteSession
    hop_index: int
    cfg: HopConfig
    on_failed: Callable[[HopSession, RouteFailure], Awaitable[None]]  # the owner ends it as failed
    on_frame: FrameHook | None = None  # called after each frame this hop finished
    life: HopLife = field(default_factory=HopLife)  # its lifecycle: changed only by apply()
    next_seq: int = 0
    next_position: int = 0
    done: int = 0
    done_position: int = 0  # tokens in this hop's cache after the last finished frame
    # the rows its driver's answer used, as the driver's close says (None: not said): a head that
    # ran ahead of a driver that left early (a stop string) claims no rows beyond them
    used_rows: int | None = None
    decode_from: int = -1  # the position of the first decode row this hop computed (-1: none yet)
    decode_end: int = 0  # past the last decode row it computed (a verify step's drafts included)
    opened_at: float = field(default_factory=time.monotonic)  # DriverWatch times silences on it
    last_active: float = field(default_factory=time.monotonic)
    counters: SessionCounters = field(default_factory=SessionCounters)
    cache_bytes_estimate: int = 0  # engine cache bytes after the last frame (for heartbeats)
    inbox: asyncio.Queue[Inbound] = field(init=False)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _watchers: int = 0  # credit polls waiting on _changed
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # set once stop() is through
    _worker: asyncio.Task[None] | None = None
    _link: FrameLink | None = None
    _step_headers: dict[tuple[str, int, int], StepHeaders] = field(default_factory=dict)  # the next hop's lane headers
    _current: Inbound | None = None  # the frame the worker has in hand
    _return: TokenReturn | None = None  # a tail's Return Stream to the head (direct return)
    _direct: Inbound | None = None  # a tail's decode step handed to the scheduler from admission
    _direct_done: asyncio.Future[None] | None = None  # set once that step is answered
    _next_token: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int32))
    credential: str = field(init=False, repr=False)  # what a sender to this hop must present
    next_credential: str = field(init=False, repr=False)  # what this hop presents to the next
    # a Kept Hop (a restart continuing this node's session of the lost route): positions its
    # Hot KV State already holds (rows below are not computed again), and its Seam Log
    kept: int = 0
    seam_log: SeamLog | None = None  # non-tail: every row sent to the next hop, by position
    inbound_log: SeamLog | None = None  # non-head, with Hop Evidence on: every row received, by position
    need_next: int = field(init=False, default=0)  # the first position the next hop needs rows for
    _seq_skip: int = field(init=False, default=0)  # frames not sent on (nothing the next hop needs)
    # after a verify step (speculative decoding): the earliest position the next decode frame
    # may start at, dropping the drafts the tail did not keep; -1: none may start early. With
    # pipelined verify steps that is inside the oldest step the head may not have had answered
    # yet: one of the last SPEC_DEPTH (`_floors`, each step's position + 1).
    rewind_floor: int = field(init=False, default=-1)
    _floors: deque[int] = field(init=False, default_factory=lambda: deque(maxlen=SPEC_DEPTH))
    _booked: int = field(init=False, default=-1)  # past the head: decode tokens booked up to here (-1: none)
    _expect: tuple[int, int] | None = field(init=False, default=None)  # tail: (position, token) the last step made
    history: list[int] = field(init=False, default_factory=list)  # head: the token ids in its KV, by position

    def __post_init__(self) -> None:
        # credit bounds frames, a lane's window its steps (up to SPEC_DEPTH + 1 in flight)
        self.inbox = asyncio.Queue(maxsize=max(self.cfg.window, SPEC_DEPTH + 1))
        hops, i = self.route.hops, self.hop_index
        self.next_position = inbound_start(hops, i)
        self.done_position = self.kept
        if i + 1 < len(hops):
            self.need_next = inbound_start(hops, i + 1)
            if self.seam_log is None:
                self.seam_log = SeamLog(self.cfg.hidden_size, self.cfg.n_ctx)
        if self.cfg.evidence is not None and self.cfg.evidence.enabled:
            if i > 0:
                self.inbound_log = SeamLog(self.cfg.hidden_size, self.cfg.n_ctx)
            hop = hops[i]
            self.cfg.evidence.track(HopRecord(
                self.route.session_id, self.route.route_id, i, hop.layer_start, hop.layer_end, self.cfg.hidden_size,
                self.inbound_log, self.seam_log, self.kept))
        r, key, i = self.route, self.cfg.frame_key, self.hop_index
        scope = (r.session_id, r.route_id, r.epoch, i, r.expires_at)
        self.credential = hop_credential(key, *scope) if key else ""
        sealed = r.hops[i].sealed_next
        self.next_credential = unseal(key, sealed, *scope) if key and sealed else ""

    @property
    def session_id(self) -> str:
        return self.route.session_id

    @property
    def is_head(self) -> bool:
        return self.hop_index == 0

    @property
    def is_tail(self) -> bool:
        return self.hop_index == len(self.route.hops) - 1

    @property
    def token_return(self) -> TokenReturn:
        """A tail's Return Stream box (made on first use)."""
        if self._return is None:
            self._return = TokenReturn()
        return self._return

    @property
    def direct_return(self) -> bool:
        """Whether this head's Decode Runs take their tokens straight from the tail."""
        return self.is_head and len(self.route.hops) >= DIRECT_RETURN_HOPS

    @property
    def credit(self) -> int:
        return credit_limit(self.done, self.cfg.window)

    @property
    def open(self) -> bool:
        """The session has not ended on this hop."""
        return self.life.phase.open

    @property
    def failure(self) -> RouteFailure | None:
        """What the ended session's frames are answered with."""
        return self.life.failure

    def apply(self, event: Event) -> bool:
        """Change the session's HopLife by `event` (hop_machine.transition); whether it changed."""
        before, self.life = self.life, transition(self.life, event)
        return self.life is not before

    def begin_stream(self) -> None:
        """A lane from the previous hop now carries the decode steps."""
        self.apply(StreamIn())

    def end_stream(self) -> None:
        """The lane let go of the session."""
        self.apply(StreamOut())

    def view(self) -> SessionView:
        """The admission view of this session."""
        return SessionView(
            route_id=self.route.route_id, epoch=self.route.epoch, hop_index=self.hop_index,
            next_seq=self.next_seq, next_position=self.next_position, credit=self.credit,
            decoding=self.life.phase.decoding, running=self.life.phase.holds_steps, is_head=self.is_head,
            hidden_size=self.cfg.hidden_size,
            n_ctx=self.cfg.n_ctx, rewind_floor=self.rewind_floor,
        )

    def start(self) -> None:
        """Start the worker that runs accepted frames in order."""
        self._worker = asyncio.create_task(self._run(), name=f"hop-session-{self.session_id}")

    def accept(self, header: FrameHeader, rows: np.ndarray, wire_bytes: int, body_bytes: int,
               reply: ReplySink | None = None, emit: RunEmit | None = None, *,
               seq: int | None = None, position: int | None = None, drafts: list[int] | None = None,
               guess: int = -1, upstream: list[HopMark] | None = None) -> Inbound:
        """Queue an admitted frame (a tail's decode step with an idle worker runs at once,
        `_can_run_now`); the caller checked it with check_frame first.

        A final frame needs `reply`: it is called exactly once, synchronously where the frame
        finishes (the worker, or stop()), so the answer leaves without another task switch.
        A Decode Run also needs `emit`, called with each token as the run makes it. A lane's
        steps share the lane's header and give their own `seq` and `position` (and on a
        speculative lane their `drafts` and `guess`; on a direct one the `upstream` hops'
        timings)."""
        if header.final and reply is None:
            raise ValueError("a final frame needs a reply sink")
        if header.is_run and emit is None:
            raise ValueError("a Decode Run needs a token stream")
        item = Inbound(header, rows, rows.nbytes, time.perf_counter(),
                       header.seq if seq is None else seq, header.position if position is None else position,
                       reply if header.final else None, emit, drafts=drafts, guess=guess, upstream=upstream)
        self._book_kept(header, item.position)
        if item.position < self.next_position:  # a decode frame after a verify step (admission checked)
            self._rewound(item.position)
        if self.inbound_log is not None:
            self.inbound_log.put(item.position, rows)
        now = self._can_run_now(header)
        if not now:
            self.inbox.put_nowait(item)  # cannot overflow: credit (frames) and lane windows (steps) bound it
        self.next_seq += 1
        self.next_position = item.position + len(rows)
        self._floor(header, item.position, guess)
        if header.is_run:
            self.apply(RunIn())
        elif header.final and header.phase == "prefill":
            self.apply(PromptIn())
        c = self.counters
        c.frames += 1
        c.rx_bytes += wire_bytes
        c.rx_body_bytes += body_bytes
        c.last_rx_bytes = wire_bytes
        if header.phase == "decode":
            c.decode_frames += 1
            c.decode_rx_bytes += wire_bytes
        c.buffered += 1
        c.buffered_bytes += item.nbytes
        c.max_buffered = max(c.max_buffered, c.buffered)
        c.max_buffered_bytes = max(c.max_buffered_bytes, c.buffered_bytes)
        self.last_active = time.monotonic()
        if now:
            self._run_now(item)
        return item

    def _book_kept(self, h: FrameHeader, position: int) -> None:
        """Between head and tail, a speculative lane's step (or the next frame) shows how many
        drafts the steps before it kept: every position up to its own was kept (a step back
        unbooks what a voided guess had shown). The tail books its tokens at once; a step's
        first row books itself when it runs."""
        if self.is_tail or self.is_head:  # (the head books its run's tokens as they come)
            return
        if self._booked >= 0 and h.phase == "decode":  # (a plain run's lane after a speculative one shows its last step's)
            self.counters.decode_tokens += position - self._booked
        self._booked = position + 1 if h.draft else -1

    def _floor(self, h: FrameHeader, position: int, guess: int) -> None:
        """Where the next step may start back (rewind_floor), after a step at `position`: inside
        this one, or in a pipelined step before it that the head may not know the end of yet
        (a step sent after an answer, `guess` -1, settles everything before it)."""
        lane = h.draft > 0 and h.stream  # a speculative lane's step (not the run's frame to the head)
        if not lane or guess < 0:
            self._floors.clear()
        if lane:
            self._floors.append(position + 1)
        self.rewind_floor = min(self._floors) if self._floors else -1

    def voids(self, item: Inbound) -> bool:
        """Whether the tail voids a pipelined step: the step before did not end where and with
        the token the head guessed (its rows are not run; the head's next step goes back)."""
        void = item.guess >= 0 and self._expect != (item.position, item.guess)
        self.counters.voided_steps += void
        return void

    def drop_logs(self) -> SeamLog | None:
        """Let go of this hop's row logs once its state is freed or handed on: an ended session
        stays in the table's `ended` (1024 of them) for late frames, and the logs it kept would
        outlive the Evidence Shelf's byte budget (the shelf's copy is the validator's). Returns
        the Seam Log, for a restart that continues it."""
        seam_log, self.seam_log, self.inbound_log = self.seam_log, None, None
        return seam_log

    def _rewound(self, position: int) -> None:
        """Forget what this hop logged from `position` on: drafts the tail did not keep (the
        engine drops their KV rows with the frame's model call, BatchPart.rewind)."""
        for log_ in (self.inbound_log, self.seam_log):
            if log_ is not None:
                log_.cut(position)
        del self.history[position:]

    def _can_run_now(self, h: FrameHeader) -> bool:
        """A tail's decode step goes to the scheduler at once, from the callback that admitted
        it, when the worker has nothing in hand: its answer then leaves from the scheduler's
        iteration without waking the worker task (one event-loop round trip)."""
        return (self.is_tail and h.stream and self.open
                and self._current is None and self._direct is None and self.inbox.empty()
                and not self.cfg.test_delay_s)

    def _run_now(self, item: Inbound) -> None:
        if self.voids(item):
            self._finish(item, void_result(item.position))
            self._frame_done(item.header)
            return
        self._direct = item
        self._direct_done = finished = asyncio.get_running_loop().create_future()

        def done(outcome: WorkOutcome) -> None:
            self._direct = None
            finished.set_result(None)
            if not self.open:
                return  # stop() answered the frame
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                out, secs, self.cache_bytes_estimate = outcome
                result = self._tail_result(item.header, out, secs, item.arrived, item.position, item.drafts,
                                           item.upstream)
            except Exception as exc:  # the worker fails the session, as for any frame
                item.error = exc
                self.inbox.put_nowait(item)
                return
            self._finish(item, result)
            self._frame_done(item.header)

        self.cfg.scheduler.submit(Work(self.session_id, item.position, item.rows, done,
                                       drafts=item.drafts, rewind=True))

    async def wait_credit_above(self, above: int, limit_s: float) -> None:
        """Return once credit > `above`, the session ends, or `limit_s` passes."""
        deadline = time.monotonic() + limit_s
        while self.open and self.credit <= above:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._watchers += 1
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return
            finally:
                self._watchers -= 1

    def _notify(self) -> None:
        if self._watchers:  # a new Event per frame only when someone waits (most frames: nobody)
            self._changed.set()
            self._changed = asyncio.Event()

    # --- the worker -----------------------------------------------------------------------

    async def _run(self) -> None:
        while self.open:
            item = await self.inbox.get()
            self._current = item
            try:
                result = await self._process(item)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure ends the session with a RouteFailure
                await self.fail(self._failure_for(item.header, exc))
                return
            finally:
                self._current = None
            self._finish(item, result)
            self._frame_done(item.header)

    async def _process(self, item: Inbound) -> WireResult | None:
        if item.error is not None:
            raise item.error
        if item.header.is_run:
            return await self._decode_run(item)
        if self.is_tail and item.guess >= 0:
            if self._direct_done is not None:
                await asyncio.shield(self._direct_done)  # the step before, run from admission, made its token
            if self.voids(item):
                return void_result(item.position)
        return await self._step(item.header, item.rows, item.arrived, item.seq, item.position, drafts=item.drafts,
                                guess=item.guess, upstream=item.upstream)

    async def _decode_run(self, item: Inbound) -> WireResult | None:
        """A Decode Run on the head: each token the tail returns is streamed to the caller and
        fed straight back into this shard, until the steps run out, a stop id comes, or the
        caller goes away. Every step crosses the seams downstream as a part of the run's lane.

        A token goes to the caller (and its step is booked) once the next step's row has left
        for the next hop, not before this shard's next model call: that work then overlaps the
        next hop's, instead of sitting between a token's arrival and the next step. The run's
        last token, and one held when the run fails, go out at once."""
        if item.header.draft:
            return await self._speculative_run(item)
        h, emit = item.header, item.emit
        assert emit is not None
        stop = frozenset(h.stop_ids or ())
        token, arrived = item.rows, item.arrived
        held: list[tuple[WireResult, int]] = []  # the last step's result and position, not yet sent on
        gone = False

        def hand_on() -> None:
            nonlocal gone
            if held:
                result, position = held.pop()
                gone = not emit(result) or gone
                self._step_done(h, position)

        try:
            for i in range(h.steps):
                seq, position = h.seq + i, h.position + i
                if i:  # steps after the first take the seq and position the run reserved
                    self.next_seq += 1
                    self.next_position += 1
                result = await self._step(h, token, arrived, seq, position, after_send=hand_on)
                assert result is not None, "a decode step returns a result"
                hand_on()  # a one-hop route sends nothing: the last token goes on here
                token_id = result["token_id"]
                if not run_continues(token_id, i, h.steps, stop, caller_gone=gone, session_open=self.open):
                    emit(result)
                    return result
                held.append((result, position))
                token, arrived = self._token_row(token_id), time.perf_counter()
        except BaseException:
            hand_on()  # the token before a failure still reaches the caller, ahead of the failure
            raise
        finally:
            self.end_stream_out()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _speculative_run(self, item: Inbound) -> WireResult:
        """A Decode Run whose steps may carry drafts (nodes/speculation.py): each step is the
        last token and up to `draft` tokens the Drafter proposes (as many as DraftState says
        pay). The tail answers with the drafts it kept and one token more; each goes to the
        caller as a token of its own (once the next step's rows have left, as in _decode_run),
        and the next step starts after them, every hop dropping the drafts it did not keep.
        Pipelined (_guessed): the next step may leave before the one in flight is answered,
        guessing it keeps every draft; the tail voids a step whose guess was wrong."""
        h, emit = item.header, item.emit
        assert emit is not None
        stop = frozenset(h.stop_ids or ())
        plan = DraftState(h.draft)
        token, arrived = int(item.rows[0]), item.arrived
        emitted, gone, sent = 0, False, 0
        held: list[WireResult] = []  # the last step's tokens, not yet sent on
        flight: deque[_Verify] = deque()  # steps sent and not answered, oldest first

        def hand_on() -> None:
            nonlocal gone
            for r in held:
                gone = not emit(r) or gone
                self._step_done(h, r["position"] - 1)
            held.clear()

        async def send(step: _Verify) -> None:
            nonlocal sent
            step.seq = h.seq + sent  # the next hop numbers every step it gets (voided ones too)
            sent += 1
            self.counters.guessed_steps += step.guess >= 0
            flight.append(step)
            await self._verify_send(h, step, hand_on)

        try:
            while True:
                if not flight:  # the next step starts where the last answer ended
                    await send(self._next_verify(plan, h.position + emitted, token, -1, h.steps - emitted, arrived))
                while not gone and (step := self._guessed(plan, flight, h, emitted, stop)) is not None:
                    await send(step)
                hand_on()  # (when no step left: the tokens of a step answered while another flew)
                step = flight.popleft()
                result = await self._verify_answer(step)
                answered = self._book_answer(plan, step, result)
                for r in answered:
                    emitted += 1
                    self.next_seq, self.next_position = h.seq + emitted, h.position + emitted
                    if not run_continues(r["token_id"], emitted - 1, h.steps, stop, caller_gone=gone,
                                         session_open=self.open):
                        hand_on()
                        emit(r)
                        return r
                    held.append(r)
                token, arrived = result["token_id"], time.perf_counter()
                if flight and not guess_holds(step.drafts, len(answered) - 1, token, flight[0].guess):
                    self._voided(flight)
        except BaseException:
            hand_on()  # the tokens before a failure still reach the caller, ahead of the failure
            raise
        finally:
            self._seq_skip += emitted - sent  # the next hop numbers steps, the caller tokens
            self.end_stream_out()

    def _voided(self, flight: deque[_Verify]) -> None:
        """The steps in flight were guessed wrong: the tail voids them (their first rows, booked
        here when run, were not kept)."""
        self.counters.decode_tokens -= len(flight)
        flight.clear()

    def _book_answer(self, plan: DraftState, step: _Verify, result: WireResult) -> list[WireResult]:
        """Book a verify step's answer in the run's plan and this hop's counters; its tokens,
        the kept drafts first. The step's figures (drafted, kept, pipelined) go with its first
        token, so a run that stops inside the kept drafts (a stop id, the caller's stop string)
        still reports the step."""
        kept: list[WireResult] = result.pop("drafts", [])
        if step.guess < 0:  # sent after an answer: its trip is the route's, not overlapped by the one before
            plan.measured(len(step.drafts), len(kept), time.perf_counter() - step.proposed,
                          sum(t["compute_ms"] for t in result["timings"]) / 1e3, step.proposed - step.began)
        else:
            plan.kept(len(step.drafts), len(kept))
        if not self.is_tail:  # a one-hop route's tail booked them
            self.counters.decode_tokens += len(kept)
        answered = [*kept, result]
        if step.drafts:
            figures = {"drafted": result.pop("drafted", len(step.drafts)), "accepted": result.pop("accepted", len(kept))}
            answered[0].update(figures, **({"pipelined": True} if step.guess >= 0 else {}))
        return answered

    def _next_verify(self, plan: DraftState, position: int, token: int, guess: int, remaining: int,
                     arrived: float) -> _Verify:
        """The verify step at `position` whose first row is `token`: its drafts, as many as the
        plan says for `remaining` wanted tokens."""
        began = time.perf_counter()
        k = plan.length(remaining, self.cfg.scheduler.decoding())
        self.history[position:] = [token]  # drop rejected drafts; the drafter reads, never keeps, it
        drafts = self.cfg.drafter.propose(self.session_id, self.history, k) if k else []
        return _Verify(position, token, drafts, guess, began, time.perf_counter(), arrived)

    def _guessed(self, plan: DraftState, flight: deque[_Verify], h: FrameHeader, emitted: int,
                 stop: frozenset[int]) -> _Verify | None:
        """The pipelined step after the ones in flight, or None: it pays only while this hop
        decodes nothing else (a voided step's rows cost the others' batch) and the odds are
        good, and it must not reach past the run's last step or a stop id."""
        depth = min(self.cfg.verify_depth, SPEC_DEPTH)
        if len(flight) >= depth or self.is_tail or self.cfg.scheduler.decoding() > 1:
            return None
        if not guess_pays(plan.acceptance, [len(f.drafts) for f in flight], plan.streak, plan.d_s, plan.latency_s):
            return None
        last = flight[-1]
        position = last.position + 1 + len(last.drafts)
        remaining = h.steps - emitted - sum(1 + len(f.drafts) for f in flight)
        if remaining < 1 or any(t in stop for f in flight for t in f.drafts):
            return None
        guess = self.cfg.drafter.propose(self.session_id, self.history, 1)  # (it ends at `position`)
        if not guess or guess[0] in stop:
            return None
        return self._next_verify(plan, position, guess[0], guess[0], remaining, time.perf_counter())

    async def _verify_send(self, h: FrameHeader, step: _Verify, after_send: Callable[[], None]) -> None:
        """Run a verify step's rows on this hop and send them on; its answer is read by
        _verify_answer (a one-hop route's tail has it at once)."""
        rows = np.asarray([step.token, *step.drafts], dtype=np.int32)
        spent = self.counters.compute_s
        step.result = await self._step(h, rows, step.arrived, step.seq, step.position, after_send,
                                       step.drafts or None, step.guess, pending=True)
        step.compute_s = self.counters.compute_s - spent  # this hop's model call (_count_compute)

    async def _verify_answer(self, step: _Verify) -> WireResult:
        """The tail's answer to `step`, the oldest in flight (voided steps' answers skipped)."""
        if self.is_tail:
            assert step.result is not None, "a decode step returns a result"
            return step.result
        link = self._link_to_next()
        seq, direct = step.seq - self._seq_skip, self.direct_return
        while True:
            result = await link.stream_answer(seq, direct=direct, position=step.position)
            if result is None:
                raise EngineError("next hop returned no result for a verify step")
            if not result.get("void"):
                break
        if not step.position < result["position"] <= step.position + 1 + len(step.drafts):
            raise EngineError(f"the answer for position {result['position']} is not the verify step at "
                              f"{step.position}'s")
        result["timings"].insert(0, wire_timing(self.cfg.node_id, step.compute_s * 1e3,
                                                (time.perf_counter() - step.arrived) * 1e3))
        return result

    def _token_row(self, token_id: int) -> np.ndarray:
        """The head's input for a Decode Run's next step: one reused int32 row (the engine
        reads it during the call and keeps nothing)."""
        row = self._next_token
        row[0] = token_id
        return row

    def end_stream_out(self, lost_hop: int | None = None) -> None:
        """End the lane to the next hop, if one is open (a Decode Run ended here, or the lane
        that fed this hop ended; `lost_hop`: was lost, the link after that hop broken)."""
        if self._link is not None:
            self._link.end_stream(lost_hop)

    def _step_done(self, h: FrameHeader, position: int) -> None:
        """Book a Decode Run's step as a finished frame (the run's last step is the item's)."""
        self.done += 1
        self.done_position = position + 1
        self.last_active = time.monotonic()
        self._notify()
        self._frame_done(h)

    async def _step(self, h: FrameHeader, rows: np.ndarray, arrived: float, seq: int,
                    position: int, after_send: Callable[[], None] | None = None,
                    drafts: list[int] | None = None, guess: int = -1, *,
                    pending: bool = False, upstream: list[HopMark] | None = None) -> WireResult | None:
        """Run one frame's rows (`h` at `seq` and `position`: a Decode Run's steps share `h`);
        `after_send` runs once the rows have left for the next hop, before its answer. A
        verify step's rows 1.. are `drafts` (speculative decoding); a pipelined one's `guess`
        goes on with it, for the tail. `pending`: return once the rows have left (a head's
        verify step, whose answer _verify_answer reads); a tail answers at once anyway.

        A final frame's result travels as its JSON object (WireResult), the tail's token with
        each hop's timing in front: no model object per token (see "per-token wire path")."""
        if self.cfg.test_delay_s:
            await asyncio.sleep(self.cfg.test_delay_s)
        if self.is_head and position <= len(self.history):  # what prompt lookup drafts from
            self.history[position:] = rows.tolist()
        held = min(max(0, self.kept - position), len(rows))  # a Kept Hop's rows already in its KV
        if held:
            return await self._step_kept(h, rows, arrived, seq, position, held)
        decode = h.phase == "decode"
        out, secs, self.cache_bytes_estimate = await self.cfg.scheduler.run(
            self.session_id, position, rows, sample=h.final, stepwise=h.stepwise, rebuild=self._rebuild(h),
            drafts=drafts, rewind=decode)
        self.counters.shared_prefix_tokens += out.reused
        if self.is_tail:
            return self._tail_result(h, out, secs, arrived, position, drafts, upstream)
        # a verify step books its first row; the drafts it keeps count once the next frame shows them
        self._count_compute(h, secs, position + out.reused, 1 if drafts else len(rows) - out.reused,
                            position + len(rows))
        if out.hidden is None:
            raise EngineError("non-tail shard returned no hidden rows")
        assert self.seam_log is not None
        self.seam_log.put(position, out.hidden)
        hidden, send_from = out.hidden, max(position, self.need_next)
        if send_from > position:  # a restart: the next hop keeps these rows
            if self._keeps_all(h, send_from, position + len(rows)):
                return None
            hidden = hidden[send_from - position:]
        return await self._send_on(h, hidden, seq, send_from, arrived, secs, after_send, drafts, guess, pending,
                                   upstream)

    def _rebuild(self, h: FrameHeader) -> bool:
        return self.rebuilds(h, moved=self.route.moved)

    @staticmethod
    def rebuilds(h: FrameHeader, *, moved: bool) -> bool:
        """Whether a frame's rows rebuild a restarted stream's history (pure): a prefill of a
        route whose epoch is > 1, not a move's (`moved`: that stream lost nothing and waits its
        turn). The hop scheduler runs those first (plan_batch)."""
        return h.phase == "prefill" and h.epoch > 1 and not moved

    def _keeps_all(self, h: FrameHeader, send_from: int, end: int) -> bool:
        """Whether the next hop keeps every row of this frame (a restart's rebuild): nothing
        goes on, and the next hop's frame numbers skip it."""
        if send_from < end:
            return False
        if h.final:
            raise EngineError("a final frame left nothing to send on")
        self._seq_skip += 1
        return True

    async def _step_kept(self, h: FrameHeader, rows: np.ndarray, arrived: float, seq: int, position: int,
                         held: int) -> WireResult | None:
        """A restart's rebuild frame on a Kept Hop whose first `held` rows are already in its KV:
        it computes only the rest, and sends the next hop the rows it needs, the ones it made
        before from its Seam Log. A tail's kept rows never arrive (inbound_start)."""
        secs = 0.0
        hidden: np.ndarray | None = None
        if held < len(rows):
            out, secs, self.cache_bytes_estimate = await self.cfg.scheduler.run(
                self.session_id, position + held, rows[held:], sample=h.final, stepwise=h.stepwise,
                rebuild=self._rebuild(h))
            hidden = out.hidden
            if hidden is None:
                raise EngineError("non-tail shard returned no hidden rows")
        self._count_compute(h, secs, position + held, len(rows) - held, position + len(rows))
        assert self.seam_log is not None
        if hidden is not None:
            self.seam_log.put(position + held, hidden)
        send_from, end = max(position, self.need_next), position + len(rows)
        if self._keeps_all(h, send_from, end):
            return None
        return await self._send_on(h, self.seam_log.rows(send_from, end), seq, send_from, arrived, secs)

    async def _send_on(self, h: FrameHeader, hidden: np.ndarray, seq: int, position: int, arrived: float,
                       secs: float, after_send: Callable[[], None] | None = None,
                       drafts: list[int] | None = None, guess: int = -1,
                       pending: bool = False, upstream: list[HopMark] | None = None) -> WireResult | None:
        """Send a frame's output rows (from `position`) to the next hop; a final frame's result
        (none yet when `pending`). On a direct lane a middle hop's timing goes on with the rows
        (the tail's answer does not pass it); the head's joins the answer when it comes."""
        marks = [*(upstream or ()), (self.hop_index, secs * 1e3, (time.perf_counter() - arrived) * 1e3)] \
            if h.direct and not self.is_head else None  # a middle hop on a direct lane
        result = await self._forward(h, hidden, seq, position, after_send, drafts, guess, pending=pending,
                                     marks=marks)
        if pending or not h.final or (h.direct and result is None):  # a direct step: the tail answers the head
            return None
        if result is None:
            raise EngineError("next hop returned no result for a final frame")
        result["timings"].insert(0, wire_timing(self.cfg.node_id, secs * 1e3, (time.perf_counter() - arrived) * 1e3))
        return result

    def _count_compute(self, h: FrameHeader, secs: float, position: int, rows: int, end: int) -> None:
        """Book `rows` computed rows from `position` (the frame's, but for rows a Kept Hop held or
        a shared prefix gave: the ledger pays a hop for the rows it computed; a verify step books
        its drafts once kept), the frame's computed rows ending at `end`."""
        self.counters.compute_s += secs
        if h.phase == "prefill":
            self.counters.prefill_tokens += rows
            return
        self.counters.decode_tokens += rows
        if self.decode_from < 0 and rows:
            self.decode_from = position
        self.decode_end = max(self.decode_end, end)

    def _tail_result(self, h: FrameHeader, out: ShardOutput, secs: float, arrived: float,
                     position: int, drafts: list[int] | None = None,
                     upstream: list[HopMark] | None = None) -> WireResult | None:
        """The tail's answer to a frame it ran: the token of a final frame (and of a verify
        step, the drafts it kept), else nothing; after the middle hops' timings on a direct
        lane (`upstream`)."""
        self._count_compute(h, secs, position + out.reused,
                            1 + len(out.accepted) if drafts else h.n_rows - out.reused,
                            position + 1 + len(drafts) if drafts else position + h.n_rows)  # (a lane's `h` is its first step's)
        if not h.final:
            return None
        if out.token is None:
            raise EngineError("tail shard returned no token")
        t = out.token
        mine = wire_timing(self.cfg.node_id, secs * 1e3, (time.perf_counter() - arrived) * 1e3)
        now_ms = time.monotonic() * 1e3
        kept = len(out.accepted)
        after = position + 1 + kept if drafts else position + h.n_rows  # the session's position after the frame
        self._expect = (after, t.token_id)  # what a pipelined step after this one must guess
        result = wire_result(t.token_id, after, mine, t.logprob, t.top_logprobs, sampled_ms=now_ms)
        if upstream:
            hops = self.route.hops
            result["timings"][:0] = [wire_timing(hops[i].node_id, c, hd) for i, c, hd in upstream]
        if drafts:  # a verify step: the kept drafts go back too, each at its position
            self.counters.drafted_tokens += len(drafts)
            self.counters.accepted_tokens += kept
            result["drafted"], result["accepted"] = len(drafts), kept
            result["drafts"] = [wire_result(c.token_id, position + 1 + j, mine, c.logprob, c.top_logprobs,
                                            sampled_ms=now_ms) for j, c in enumerate(out.accepted)]
        return result

    async def _forward(self, h: FrameHeader, hidden: np.ndarray, seq: int, position: int,
                       after_send: Callable[[], None] | None = None,
                       drafts: list[int] | None = None, guess: int = -1, *,
                       pending: bool = False, marks: list[HopMark] | None = None) -> WireResult | None:
        """Send a frame's output rows to the next hop; the tail's result for a final frame,
        unless `pending` (a pipelined verify step of a Decode Run: its answer is read later,
        _verify_answer). A direct lane's step starts with the middle hops' timings, `marks`."""
        link = self._link_to_next()
        seq -= self._seq_skip  # the next hop numbers only the frames it gets
        comp = choose_compression(self.cfg.compression, link.accepted)
        streamed = h.phase == "decode"  # a decode step goes on as a part of its run's lane on the Seam Link
        if streamed:
            steps = self._decode_headers(h, comp, hidden.shape[1])
        else:
            header = self._next_header(h, comp, hidden.shape[1]).model_copy(
                update={"seq": seq, "position": position, "n_rows": len(hidden)}).to_header()
        if comp == "zstd" and hidden.shape[0] > 8:
            body = await asyncio.to_thread(encode_rows, hidden, self.cfg.wire_dtype, comp)
        else:
            body = encode_rows(hidden, self.cfg.wire_dtype, comp)
        if streamed and steps.template.draft:  # a speculative stream: the step says its position, guess and drafts
            body = step_chunk(position, drafts or (), body, guess)
        if streamed and steps.template.direct:
            body = upstream_chunk(marks or (), body)
        waits = link.stats.credit_waits
        c = self.counters
        c.buffered_bytes += len(body)  # the outbound rows are held until the next hop accepts them
        c.max_buffered_bytes = max(c.max_buffered_bytes, c.buffered_bytes)
        try:
            if pending:
                await link.stream_send(seq, lambda: steps.render(seq, position), body, after_send,
                                       direct=steps.template.direct)
                result: WireResult | None = None
            elif streamed:
                result = await link.stream_step(
                    seq, lambda: steps.render(seq, position), body, after_send,
                    direct=steps.template.direct, position=position)
            elif h.final:  # a prompt's last chunk: the next hop answers with the tail's token
                result = await link.send_step(seq, header, body)
            else:  # an earlier chunk goes on without waiting for its ack (a far next hop's round trip)
                await link.post(seq, header, body)
                result = None
        finally:
            c.buffered_bytes -= len(body)
            c.credit_waits += link.stats.credit_waits - waits
        self.counters.tx_body_bytes += len(body)
        return result

    def _next_header(self, h: FrameHeader, comp: Compression, width: int, stream: bool = False) -> FrameHeader:
        """`h` as the next hop receives it: its hop index, our wire dtype, one step: a prompt
        chunk's frame, or (`stream`) the header a run's lane opens with."""
        return h.model_copy(update={
            "hop": self.hop_index + 1, "dtype": self.cfg.wire_dtype, "width": width,
            "compression": comp, "draft": h.draft if stream else 0, "steps": 1, "stop_ids": None, "flush_ms": 0,
            "stream": stream, "direct": stream and (h.direct or (h.is_run and self.direct_return)),
        })

    def _decode_headers(self, h: FrameHeader, comp: Compression, width: int) -> StepHeaders:
        key = (comp, width, h.draft)  # a run's lane drafts as its header says (a plain run's does not)
        sh = self._step_headers.get(key)
        if sh is None:
            sh = self._step_headers[key] = StepHeaders(self._next_header(h, comp, width, stream=True))
        return sh

    def _link_to_next(self) -> FrameLink:
        if self._link is None:
            nxt = self.route.hops[self.hop_index + 1]
            self._link = FrameLink(
                nxt.activation_url, hop_index=self.hop_index + 1, node_id=nxt.node_id,
                session_id=self.session_id, route_id=self.route.route_id, epoch=self.route.epoch,
                credential=self.next_credential, seam=self.cfg.seams.to(nxt.activation_url), window=nxt.window,
            )
            if self.direct_return:
                r, key, tail = self.route, self.cfg.frame_key, self.route.hops[-1]
                sealed = r.hops[0].sealed_return
                cred = unseal(key, sealed, r.session_id, r.route_id, r.epoch, 0, r.expires_at,
                              purpose="seal-return") if key and sealed else ""
                self._link.returns_from(self.cfg.seams.to(tail.activation_url), hop_index=len(r.hops) - 1,
                                        node_id=tail.node_id, credential=cred)
        return self._link

    def _finish(self, item: Inbound, result: WireResult | None) -> None:
        if item.header.is_run:
            self.apply(RunOut())
        self.done += 1
        self.done_position = max(self.kept, self.next_position if item.header.is_run
                                 else item.position + item.header.n_rows)
        if result is None and item.header.direct:  # a direct step past the head: nothing goes back
            sink, item.reply = item.reply, None
            if sink is not None:
                sink(None)
        else:  # the answer first: the caller waits on it
            self._answer(item, result if result is not None else self._missing_result(item))
        self.counters.buffered -= 1
        self.counters.buffered_bytes -= item.nbytes
        self.last_active = time.monotonic()
        self._notify()

    def _answer(self, item: Inbound, outcome: WireResult | RouteFailure | None) -> None:
        sink, item.reply = item.reply, None
        if sink is None:
            return
        if outcome is None:  # every final frame gets an answer, whatever ended the session
            outcome = self.make_failure(item.header.phase, f"session {self.life.status}", self.hop_index)
        try:
            sink(outcome)
        except Exception:  # a sink writes to a connection; it never breaks the session
            log.exception("session %s: could not answer frame %d", self.session_id, item.seq)

    def _frame_done(self, header: FrameHeader) -> None:
        if self.on_frame is None:
            return
        try:
            self.on_frame(self, header)
        except Exception:  # an observer never breaks the frame path
            log.exception("session %s: frame hook failed", self.session_id)

    def _missing_result(self, item: Inbound) -> RouteFailure:
        return self.make_failure(item.header.phase, "no result for a final frame", self.hop_index)

    def _failure_for(self, h: FrameHeader, exc: Exception) -> RouteFailure:
        s = self.route
        if isinstance(exc, HopUnreachableError):
            return failure_from_unreachable(exc, session_id=s.session_id, route_id=s.route_id, phase=h.phase)
        if isinstance(exc, FrameRejectedError):
            nxt = s.hops[self.hop_index + 1]
            return failure_from_rejection(exc, session_id=s.session_id, route_id=s.route_id,
                                          phase=h.phase, hop_index=self.hop_index + 1, node_id=nxt.node_id)
        code = exc.code if isinstance(exc, EngineError) else "engine_error"
        log.exception("session %s: frame %d failed on this hop", s.session_id, h.seq, exc_info=exc)
        return self.make_failure(h.phase, f"{type(exc).__name__}: {exc}", self.hop_index, code=code)

    def make_failure(self, phase: str, reason: str, hop_index: int | None, *, code: str = "route_failed") -> RouteFailure:
        """A RouteFailure for this session naming hop `hop_index`."""
        node = self.route.hops[hop_index].node_id if hop_index is not None else None
        return RouteFailure(session_id=self.session_id, route_id=self.route.route_id, phase=phase,  # type: ignore[arg-type]
                            hop_index=hop_index, node_id=node, reason=reason, code=code)

    @property
    def phase(self) -> str:
        """The session's phase on this hop: the frame in work, else what comes next."""
        if self._current is not None:
            return self._current.header.phase
        return "decode" if self.life.phase.decoding else "prefill"

    # --- ending ---------------------------------------------------------------------------

    async def fail(self, failure: RouteFailure) -> None:
        """End the session because the route broke; tell the owner so it frees and reports."""
        if self.open:
            await self.on_failed(self, failure)

    def end(self, how: HopPhase, reason: str, failure: RouteFailure | None = None, *,
            keep_until: float | None = None, park: bool | None = None) -> bool:
        """Record how the session ended, or that it parked (hop_machine.End), synchronously so no
        frame sees a half-ended session; False if it had ended already. An end with no failure
        but a failed one gets a `session_<how>` failure for the frames still waiting."""
        if failure is None and how is not HopPhase.FAILED and self.open:
            failure = self.make_failure(self.phase, f"session {how}: {reason}", None, code=f"session_{how}")
        return self.apply(End(how, reason, failure, self.cfg.node_id, keep_until, park))

    async def stop(self) -> None:
        """Stop the worker and answer every waiting final frame; the cache is freed by the owner
        once `stopped` is set."""
        pending = [i for i in (self._direct, self._current) if i is not None]  # before the worker's finally clears it
        self._direct = None
        worker, self._worker = self._worker, None
        try:
            if worker is not None and worker is not asyncio.current_task():
                worker.cancel()
                await asyncio.gather(worker, return_exceptions=True)
            if self._link is not None:
                self._link.close()
            while not self.inbox.empty():
                pending.append(self.inbox.get_nowait())
            for item in pending:
                self._answer(item, self.failure)
            if self._return is not None:
                self._return.end(self.failure)
            self.counters.buffered = 0
            self.counters.buffered_bytes = 0
            self._notify()
        finally:
            self.stopped.set()

    def stats(self) -> dict[str, object]:
        """JSON-ready state and counters of this session."""
        r = self.life
        return {
            "session_id": self.session_id, "route_id": self.route.route_id, "epoch": self.route.epoch,
            "hop_index": self.hop_index, "state": r.status, "position": self.next_position,
            "seq": self.next_seq, "done": self.done, "credit": self.credit, "window": self.cfg.window,
            "phase": r.phase.value, "decoding": r.phase.decoding,
            "running": r.phase is HopPhase.RUNNING, "end_reason": r.reason,
            "kept": self.kept, "seam_log_bytes": self.seam_log.nbytes if self.seam_log is not None else 0,
            "returned_tokens": self._return.sent if self._return is not None else 0,  # a tail's, straight to the head
            **asdict(self.counters),
        }
