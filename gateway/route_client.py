"""RouteClient: the gateway's driver of one Route Session over the activation plane.

    async with RouteClient(session, http, bus=bus) as rc:
        first = await rc.prefill(prompt_ids, on_progress=lambda done, total: ...)
        async for res in rc.decode_run(first.token_id, steps=100, stop_ids=eog_ids):
            ...                                          # the head feeds itself; tokens stream
        nxt = await rc.decode(res.token_id)              # a Decode Run of one step

Prefill goes to the head in chunks of `chunk_size` prompt tokens under the head's credit;
the final chunk returns the tail's FrameResult. Every decode step is a Decode Run's: the
run hands the decode loop to the head, and each token comes back as the route makes it,
while the route is already computing the next one. Any failure raises RouteFailedError (phase, hop, node,
reason) after the session is aborted on every hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import ipaddress
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from types import TracebackType
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import orjson

from bus import subjects
from bus.client import Bus
from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import (
    COLOCATED_CHUNK_SIZE,
    DEFAULT_CHUNK_SIZE,
    SESSIONS_PATH,
    FrameHeader,
    FramePhase,
    FrameRejectedError,
    FrameResult,
    HopUnreachableError,
    RouteFailedError,
    encode_rows,
)
from schemas.route import Hop, RouteDirective, RouteFailure, RouteSession
from wire.link import FrameLink, failure_from_rejection, failure_from_unreachable

__all__ = ["FrameResult", "HopMark", "LinkPhase", "RouteClient", "RouteFailedError", "hop_mark", "plan_chunks"]

log = logging.getLogger("meshnet.gateway.route")

ProgressCallback = Callable[[int, int], object]
RELEASE_TIMEOUT_S = 1.0  # how long close/abort waits for each hop
# how long a restart's abort (a hop was lost) waits for the other hops' answers before the
# restart goes on: a hop of the lost node's process (a composite node's other shard) is frozen
# or gone with it, and its DELETE would hold the restart for all of RELEASE_TIMEOUT_S. The
# DELETEs still run to their own timeout; a hop that hears of the loss only after the restart's
# open continues its session as a Kept Hop all the same (nodes/server/table.py, `_adopt`).
RESTART_RELEASE_WAIT_S = 0.2
_LATE_RELEASES: set[asyncio.Task[None]] = set()  # DELETEs a restart did not wait for
STEPWISE_CHUNK = 32  # replayed tokens per frame (each row is a model call on every hop anyway)
# a hop's session counters that move as it takes a frame's rows, hands them on, computes them
MARK_FIELDS = ("position", "done", "prefill_tokens")
HopMark = tuple[int, ...] | None  # one hop's MARK_FIELDS, None when it did not answer


RAMP_DIVISORS = (4, 2)  # a ramped prefill starts with chunk/4, then chunk/2 (and ends mirrored)


def plan_chunks(n_tokens: int, chunk_size: int, *, ramp: bool = False) -> list[tuple[int, int]]:
    """Split [0, n_tokens) into consecutive half-open chunks of at most chunk_size tokens.

    With `ramp`, the prompt starts and ends with smaller chunks (chunk/4, chunk/2, ...,
    chunk/2, chunk/4) and the rest is split evenly: a pipeline of hops then spends less time
    with only its first hop busy (filling) or only its last one (draining). A prompt too short
    for that gets plain chunks."""
    if n_tokens <= 0:
        raise ValueError("a prefill needs at least one token")
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    plain = [(a, min(a + chunk_size, n_tokens)) for a in range(0, n_tokens, chunk_size)]
    if len(plain) > 1 and plain[-1][1] - plain[-1][0] == 1:
        # the sampled last row never travels alone: llama.cpp computes a one-row call with
        # other logits than the same row at the end of a chunk (docs/shard-runtime.md)
        (a, b), (_, end) = plain[-2], plain[-1]
        plain[-2:] = [(a, b - 1), (b - 1, end)]
    edge = [max(1, chunk_size // d) for d in RAMP_DIVISORS]
    middle = n_tokens - 2 * sum(edge)
    if not ramp or middle < chunk_size:
        return plain
    k = -(-middle // chunk_size)
    sizes = [*edge, *(middle // k + (i < middle % k) for i in range(k)), *reversed(edge)]
    return list(itertools.pairwise(itertools.accumulate(sizes, initial=0)))


def hop_mark(status: int, body: bytes) -> HopMark:
    """A hop's answer to GET /v1/sessions/<id> as its progress mark (pure): MARK_FIELDS of a 200
    whose JSON has them all as integers, else None."""
    if status != 200:
        return None
    try:
        stats = orjson.loads(body)
        mark = tuple(stats[f] for f in MARK_FIELDS)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return mark if all(type(v) is int for v in mark) else None


def is_loopback(url: str) -> bool:
    """Whether an activation URL points at this machine's loopback interface."""
    return is_loopback_host(urlsplit(url).hostname or "")


def is_loopback_host(host: str) -> bool:
    """Whether a host name or address is reachable only from this machine (pure)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def prefill_chunk_size(session: RouteSession) -> int:
    """Prompt tokens per prefill frame for a route (pure).

    Hops on different machines pipeline: each computes its chunk while the next hop computes
    the previous one, so chunks are small (DEFAULT_CHUNK_SIZE). Hops that all listen on
    loopback share one machine's cores, where pipelining only splits the cores between them:
    measured on 2 co-located hops (docs/benchmarks.md), one hop at a time with every core
    prefills faster, so the chunks are large (COLOCATED_CHUNK_SIZE, still bounded)."""
    return chunk_size_for_hops(session.hops)


def chunk_size_for_hops(hops: Sequence[Hop]) -> int:
    """prefill_chunk_size of a route with these hops (pure)."""
    if len(hops) > 1 and all(is_loopback(h.activation_url) for h in hops):
        return COLOCATED_CHUNK_SIZE
    return DEFAULT_CHUNK_SIZE


def _stop_reason(exc: BaseException) -> str:
    """Why a route's caller left it, as the hops and the tracker log it. A cancel is what a
    client that left and a gateway that shuts down look like here (before, both read 'caller
    stopped: CancelledError')."""
    if isinstance(exc, asyncio.CancelledError):
        return "the gateway stopped the session (its client left, or the gateway is shutting down)"
    detail = str(exc)
    return f"caller stopped: {type(exc).__name__}{': ' + detail[:120] if detail else ''}"


class LinkPhase(enum.Enum):
    """Where a RouteClient's session stands on its route."""

    NEW = "new"  # nothing sent yet: prefill comes first
    PREFILLED = "prefilled"  # decode steps and Decode Runs may follow
    UNSYNCED = "unsynced"  # in a Decode Run, or one was left before its end: only close/abort remain
    RELEASED = "released"  # closed or aborted on every hop


class RouteClient:
    """Sends one Route Session's frames to its head hop and releases the session on every hop."""

    def __init__(self, session: RouteSession, http: aiohttp.ClientSession, *,
                 chunk_size: int | None = None, bus: Bus | None = None, ramp: bool = True) -> None:
        if not session.hops:
            raise ValueError("a Route Session needs at least one hop")
        self.session = session
        self.http = http
        self.chunk_size = chunk_size or prefill_chunk_size(session)  # None: chosen for the route
        self.ramp = ramp  # ramped prefill chunks (plan_chunks)
        self.bus = bus
        self.position = 0  # KV position of the next token
        self.seq = 0
        self.phase = LinkPhase.NEW
        self.failure: RouteFailure | None = None
        self.interrupted: RouteFailure | None = None  # its driver broke the route (a lost hop, a move, a stall)
        # the rows the answer used, told to every hop by the close or abort (None: the prompt and
        # every token received, `_rows_used`): a driver that leaves a Decode Run early sets it,
        # so no hop claims the steps it ran ahead
        self.used_rows: int | None = None
        head = session.hops[0]
        self._link = FrameLink(head.activation_url, hop_index=0, node_id=head.node_id,
                               session_id=session.session_id, route_id=session.route_id,
                               epoch=session.epoch, credential=self._credential(0), window=head.window)

    @property
    def credit_waits(self) -> int:
        """How many times this client waited for the head's credit (backpressure felt)."""
        return self._link.stats.credit_waits

    async def __aenter__(self) -> RouteClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if exc is not None and self.failure is None:
            await asyncio.shield(self.abort(_stop_reason(exc)))
        else:
            await asyncio.shield(self.close())

    def _header(self, phase: FramePhase, n_rows: int, final: bool, steps: int = 1,
                stop_ids: list[int] | None = None, flush_ms: int = 0, stepwise: bool = False,
                draft: int = 0) -> FrameHeader:
        s = self.session
        return FrameHeader(session_id=s.session_id, route_id=s.route_id, epoch=s.epoch, hop=0,
                           seq=self.seq, phase=phase, position=self.position, n_rows=n_rows,
                           dtype="i32", width=1, final=final, steps=steps, stop_ids=stop_ids,
                           flush_ms=flush_ms, stepwise=stepwise, draft=draft)

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise RouteFailedError(self.failure)
        if self.interrupted is not None:
            raise RouteFailedError(self.interrupted)
        if self.phase is LinkPhase.RELEASED:
            raise RuntimeError("the Route Session was already released")
        if self.phase is LinkPhase.UNSYNCED:
            raise RuntimeError("a Decode Run was left before its end; close the Route Session")

    async def _send(self, token_ids: Sequence[int], final: bool, stepwise: bool = False,
                    on_ack: Callable[[], None] | None = None) -> FrameResult | None:
        """One prefill frame (a decode step is always a Decode Run's). A chunk before the last
        goes without waiting for its ack (`FrameLink.post`; `on_ack` runs when the head's comes);
        the last one's answer is the tail's token."""
        self._check_usable()
        header = self._header("prefill", len(token_ids), final, stepwise=stepwise)
        body = encode_rows(np.asarray(token_ids, dtype=np.int32), "i32")
        result: FrameResult | None = None
        try:
            if final:
                result = (await self._link.send(header, body)).result
            else:
                await self._link.post(header.seq, header.to_header(), body, on_ack)
        except (HopUnreachableError, FrameRejectedError) as exc:
            await self._fail(self._failure_of(exc, "prefill"))
        self.seq += 1
        self.position += len(token_ids)
        return result

    def interrupt(self, failure: RouteFailure) -> None:
        """Break the route (its driver decided: the tracker aborted it, ordered a move, or it
        stalled): drop the connection to the head, so a frame or Decode Run waiting on a frozen
        hop fails now with `failure`."""
        if self.interrupted is None and self.phase is not LinkPhase.RELEASED:
            self.interrupted = failure
            self._link.close()

    def _failure_of(self, exc: HopUnreachableError | FrameRejectedError, phase: FramePhase) -> RouteFailure:
        s = self.session
        if self.interrupted is not None:
            return self.interrupted.model_copy(update={"phase": phase})
        if isinstance(exc, HopUnreachableError):
            return failure_from_unreachable(exc, session_id=s.session_id, route_id=s.route_id, phase=phase)
        return failure_from_rejection(exc, session_id=s.session_id, route_id=s.route_id, phase=phase,
                                      hop_index=0, node_id=s.hops[0].node_id)

    async def _fail(self, failure: RouteFailure) -> None:
        self.failure = failure
        lost = failure.node_id if failure.code in ("hop_lost", "moved") else None
        await self._release("abort", failure.reason, lost_node_id=lost, moved=failure.code == "moved")
        raise RouteFailedError(failure)

    async def prefill(self, token_ids: Sequence[int], on_progress: ProgressCallback | None = None,
                      stepwise_from: int | None = None) -> FrameResult:
        """Prefill the prompt; return the tail's token for its last position.

        on_progress(done, total) is called as the head acknowledges each chunk. Tokens from
        `stepwise_from` on (a restart's replay of decoded tokens) go in frames whose rows each
        run as a model call of their own, so their KV is what their decode steps made."""
        if self.phase is not LinkPhase.NEW:
            raise RuntimeError("prefill already ran for this Route Session")
        split = len(token_ids) if stepwise_from is None else max(1, min(stepwise_from, len(token_ids)))
        chunks = [(a, b, False) for a, b in plan_chunks(split, self.chunk_size, ramp=self.ramp)]
        chunks += [(a, min(a + STEPWISE_CHUNK, len(token_ids)), True)
                   for a in range(split, len(token_ids), STEPWISE_CHUNK)]
        result: FrameResult | None = None
        for i, (a, b, stepwise) in enumerate(chunks):
            final = i == len(chunks) - 1
            acked = functools.partial(on_progress, b, len(token_ids)) if on_progress is not None else None
            result = await self._send(token_ids[a:b], final, stepwise, acked)
            if final and acked is not None:
                acked()
        self.phase = LinkPhase.PREFILLED
        assert result is not None, "the final prefill frame returns a result"
        return result

    async def hop_marks(self, timeout: float) -> tuple[HopMark, ...]:
        """Every hop's progress on this session as its counters show it (`GET /v1/sessions/<id>`
        with the hop's credential, all hops at once, each bounded by `timeout`): the rows it took,
        the frames it handed on, the rows it computed; None for a hop that did not answer. A
        prompt's rows behind the head show here while the head has nothing more to acknowledge."""
        return tuple(await asyncio.gather(*(self._hop_mark(h.activation_url, self._credential(i), timeout)
                                            for i, h in enumerate(self.session.hops))))

    async def _hop_mark(self, base_url: str, credential: str, timeout: float) -> HopMark:
        url = f"{base_url.rstrip('/')}{SESSIONS_PATH}/{self.session.session_id}"
        try:
            async with self.http.get(url, headers={CREDENTIAL_HEADER: credential},
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return hop_mark(resp.status, await resp.read())
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    async def decode(self, token_id: int) -> FrameResult:
        """Feed one token at the next position; return the tail's next token (a Decode Run
        of one step)."""
        results = [r async for r in self.decode_run(token_id, steps=1)]
        assert len(results) == 1, "a Decode Run of one step returns one token"
        return results[0]

    async def decode_run(self, token_id: int, steps: int, stop_ids: Iterable[int] = (),
                         flush_ms: int = 0, draft: int = 0) -> AsyncIterator[FrameResult]:
        """Feed `token_id` and let the head decode up to `steps` tokens by itself, stopping
        after any of `stop_ids`; yield each token as it arrives. `flush_ms` > 0 lets the head
        hold tokens and send them together at most that often (the first at once). `draft`
        > 0 lets the head draft up to that many tokens per step (speculative decoding: each
        kept draft still comes as a token of its own).

        Leaving the loop early is allowed (a stop string, a client gone): the head sees the
        connection close and stops after the step in flight; the session can then only be
        closed or aborted."""
        if self.phase is LinkPhase.NEW:
            raise RuntimeError("decode before prefill")
        if steps < 1:
            raise ValueError("a Decode Run needs at least one step")
        self._check_usable()
        header = self._header("decode", 1, True, steps=steps, stop_ids=sorted(set(stop_ids)) or None,
                              flush_ms=flush_ms, draft=draft)
        body = encode_rows(np.asarray([int(token_id)], dtype=np.int32), "i32")
        ended = False
        self.phase = LinkPhase.UNSYNCED
        try:
            async for event in self._link.run(header, body):
                if event.failure is not None:
                    await self._fail(event.failure)
                if event.end:
                    ended = True
                    break
                assert event.result is not None
                self.seq += 1
                self.position += 1
                yield event.result
        except (HopUnreachableError, FrameRejectedError) as exc:
            await self._fail(self._failure_of(exc, "decode"))
        finally:
            if self.phase is LinkPhase.UNSYNCED and ended:
                self.phase = LinkPhase.PREFILLED

    @property
    def results_ready(self) -> bool:
        """Whether the Decode Run in progress has more tokens received and not yet yielded
        (a batch the head flushed at once; see decode_run's flush_ms)."""
        return self._link.run_buffered > 0

    async def close(self) -> None:
        """Release the session's Hot KV State on every hop (idempotent)."""
        await self._release("close", "completed")

    async def abort(self, reason: str) -> None:
        """Abort the session on every hop (idempotent): frees caches, stops upstream work. After
        an interrupt for a lost hop or a move, the other hops keep their Hot KV State a while
        for the restart (as in `_fail`)."""
        i = self.interrupted
        if i is not None and i.code in ("hop_lost", "moved") and i.node_id:
            await self._release("abort", reason, lost_node_id=i.node_id, moved=i.code == "moved")
        else:
            await self._release("abort", reason)

    async def _release(self, action: str, reason: str, lost_node_id: str | None = None,
                       moved: bool = False) -> None:
        if self.phase is LinkPhase.RELEASED:
            return
        used = None if lost_node_id else self._rows_used()  # a restart's abort leaves the hops their count
        self.phase = LinkPhase.RELEASED
        self._link.close()
        s = self.session
        # a lost hop is not asked (it may be frozen: the DELETE would wait out its timeout); a
        # hop the session moved off is alive and frees its cache now (it is the `lost` hop
        # itself, so it does not keep it)
        calls = [self._delete(h.activation_url, self._credential(i), action, reason, lost_node_id, used)
                 for i, h in enumerate(s.hops) if moved or h.node_id != lost_node_id]
        published = self._publish(action, reason, lost_node_id, moved, used) if self.bus is not None else None
        if not lost_node_id or moved:
            await asyncio.gather(*calls, *([published] if published is not None else []))
            return
        deletes = [asyncio.ensure_future(c) for c in calls]
        if published is not None:
            await published
        if deletes:
            _, late = await asyncio.wait(deletes, timeout=RESTART_RELEASE_WAIT_S)
            for task in late:
                _LATE_RELEASES.add(task)
                task.add_done_callback(_LATE_RELEASES.discard)

    def _rows_used(self) -> int | None:
        """The rows the answer used, as the hops are told when the route ends: what the driver
        set, else the prompt and every token this client received, the last one's row too (the
        ledger's cap); none before the prompt went."""
        if self.used_rows is not None:
            return self.used_rows
        return self.position + 1 if self.position else None

    def _credential(self, hop_index: int) -> str:
        """Hop `hop_index`'s frame credential, from the route reply (schemas/credentials.py)."""
        creds = self.session.credentials
        return creds[hop_index] if hop_index < len(creds) else ""

    async def _delete(self, base_url: str, credential: str, action: str, reason: str,
                      lost_node_id: str | None = None, used: int | None = None) -> None:
        url = f"{base_url.rstrip('/')}{SESSIONS_PATH}/{self.session.session_id}"
        params = {"route_id": self.session.route_id, "action": action, "reason": reason[:200]}
        if used is not None:
            params["used"] = str(used)
        if lost_node_id:  # the hop keeps its Hot KV State a while, for a restart to continue on it
            params["lost"] = lost_node_id
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            timeout = aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_S)
            async with self.http.delete(url, params=params, timeout=timeout,
                                        headers={CREDENTIAL_HEADER: credential}) as resp:
                await resp.read()

    async def _publish(self, action: str, reason: str, lost_node_id: str | None = None,
                       moved: bool = False, used: int | None = None) -> None:
        assert self.bus is not None
        directive = RouteDirective(action=action, session=self.session, reason=reason,  # type: ignore[arg-type]
                                   issued_by="gateway", lost_node_id=lost_node_id, moved=moved,
                                   used_rows=used)
        try:
            await self.bus.publish(subjects.route_directive(self.session.route_id), directive)
        except Exception as exc:
            log.warning("could not publish %s directive for %s: %s", action, self.session.session_id, exc)
