"""Activation frames: the binary HTTP data plane between a caller and the hops of a route.

One frame is one HTTP POST to `<activation_url>/v1/frames`. Its typed header travels as
compact JSON in the `x-meshnet-frame` HTTP header, so a hop validates session, route, epoch,
sequence, position and credit before it reads the body or runs its model. The body is raw
little-endian rows: int32 token ids into a head shard, f32/f16/bf16 hidden rows across a
seam, optionally zstd level 1. Replies are small JSON: a FrameAck (credit, and the tail's
FrameResult for a final frame) or a FrameError (typed code, and a RouteFailure on 502).

A Decode Run (a decode frame with `steps` > 1, sent to the head) lets the head drive the
decode loop itself: it feeds each token the tail returns back into its own shard, and
streams every token to the caller as one chunk of a chunked HTTP response (RunEvent JSON),
so the caller is off the per-token path. With `flush_ms` the head holds tokens and writes
them together at most that often (the first token and the run's end at once), so the caller
is woken once per batch instead of once per token.

Past the head, a run's steps cross each seam as one Step Stream (a FrameHeader with
`stream`): one POST whose chunked body carries one step's rows per chunk, answered by one
RunEvent chunk per step, so a step costs no request head, header validation or admission
(FrameLink.stream_step / end_stream; the receiver is nodes/server/step_stream.py).

Both sides of the plane use this module: the gateway's route client and every node's
forwarder (planes never import each other). See docs/activation-protocol.md.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import numpy as np
import orjson
import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.route import Phase, RouteFailure

FRAME_HEADER = "x-meshnet-frame"
FRAMES_PATH = "/v1/frames"
SESSIONS_PATH = "/v1/sessions"
MAX_ROWS = 4096  # rows per frame; bounds a frame body before it is read
MAX_HEADER_BYTES = 4096
DEFAULT_CHUNK_SIZE = 64  # prompt tokens per prefill frame across machines: small chunks pipeline the hops
COLOCATED_CHUNK_SIZE = 512  # hops sharing one machine's cores: one hop at a time, each with every core
DEFAULT_WINDOW = 4  # frames a receiver buffers beyond what it has processed
CREDIT_POLL_S = 5.0  # longest a credit long-poll is held before it answers "no change"
MAX_RUN_STEPS = 1 << 20  # decode steps one Decode Run may ask for (the context bounds it first)
MAX_STOP_IDS = 256
MAX_RUN_FLUSH_MS = 1000  # longest a Decode Run may hold its tokens before writing them
RUN_CONTENT_TYPE = "application/x-ndjson"
STREAM_END_S = 5.0  # longest a sender waits for a Step Stream's last answer before dropping the connection

FramePhase = Literal["prefill", "decode"]
WireDtype = Literal["i32", "f32", "f16", "bf16"]
Compression = Literal["none", "zstd"]
COMPRESSIONS: tuple[Compression, ...] = ("none", "zstd")
_ITEMSIZE: dict[str, int] = {"i32": 4, "f32": 4, "f16": 2, "bf16": 2}


class FrameHeader(BaseModel):
    """What a hop needs to accept or reject a frame before reading its body."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str = Field(min_length=1, max_length=128)
    route_id: str = Field(min_length=1, max_length=128)
    epoch: int = Field(ge=0)
    hop: int = Field(ge=0)  # index of the receiving hop in RouteSession.hops
    seq: int = Field(ge=0)  # frame index within the session on this seam: prefill chunks, then decode steps
    phase: FramePhase
    position: int = Field(ge=0)  # KV position of the first row
    n_rows: int = Field(ge=1, le=MAX_ROWS)
    dtype: WireDtype
    width: int = Field(ge=1)  # row width: hidden_size, or 1 for token ids
    compression: Compression = "none"
    final: bool = False  # the caller waits for the tail's token for the last row
    token_ids: list[int] | None = None  # optional sideband (e.g. the tokens a row came from)
    steps: int = Field(default=1, ge=1, le=MAX_RUN_STEPS)  # > 1: a Decode Run (head only)
    stop_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_IDS)  # a run ends on these tokens
    flush_ms: int = Field(default=0, ge=0, le=MAX_RUN_FLUSH_MS)  # a run writes held tokens at most this often
    stream: bool = False  # a Step Stream: a chunked body, one chunk per decode step from this seq and position
    stepwise: bool = False  # prefill: every row runs as a model call of its own, as decode steps did (a restart's replay)

    @property
    def is_run(self) -> bool:
        """Whether this frame asks the head for a Decode Run (a streamed answer)."""
        return self.steps > 1

    @property
    def raw_size(self) -> int:
        """Body size in bytes before compression."""
        return self.n_rows * self.width * _ITEMSIZE[self.dtype]

    def to_header(self) -> str:
        """Compact JSON for the `x-meshnet-frame` HTTP header (defaults left out).

        Built from the (already validated) field values with orjson rather than model_dump:
        it runs on every decode step, right after a model call has flushed the CPU caches,
        where pydantic's serializer costs ~10x its warm time (see "per-token wire path")."""
        return orjson.dumps({k: v for k, v in self.__dict__.items() if v != _HEADER_DEFAULTS[k]}).decode()

    @classmethod
    def from_header(cls, raw: str) -> FrameHeader:
        """Parse the HTTP header value; raise FrameFormatError on anything invalid."""
        if len(raw) > MAX_HEADER_BYTES:
            raise FrameFormatError(f"frame header is {len(raw)} bytes (max {MAX_HEADER_BYTES})")
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise FrameFormatError(f"bad frame header: {exc.errors()[0]['msg']}") from exc


class StepHeaders:
    """The headers of one seam's decode frames, which differ only in seq and position.

    Rendered from one template per session instead of a model copy and dump per token (a
    pydantic copy per token is measurable on the per-token path)."""

    def __init__(self, template: FrameHeader) -> None:
        self.template = template
        self._base = {k: v for k, v in template.__dict__.items()
                      if v != _HEADER_DEFAULTS[k] and k not in ("seq", "position")}

    def render(self, seq: int, position: int) -> str:
        """The `x-meshnet-frame` value of the template at `seq` and `position`."""
        return orjson.dumps({**self._base, "seq": seq, "position": position}).decode()


class HopTiming(BaseModel):
    """How long one hop spent on a final frame: in its model, and end to end."""

    node_id: str
    compute_ms: float
    handle_ms: float


class FrameResult(BaseModel):
    """The tail's sampled token for the last row of a final frame, passed back up the route."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = Field(default_factory=list)
    position: int  # session position after this frame
    timings: list[HopTiming] = Field(default_factory=list)  # head first
    # the tail's monotonic clock (ms) when it sampled the token: one tail serves the whole
    # session, so the difference between two tokens' stamps is the time between them as generated
    sampled_ms: float | None = None


class FrameAck(BaseModel):
    """A hop accepted (and for a final frame, completed) frame `seq`; it grants new credit."""

    seq: int
    credit: int  # cumulative: the sender may send frames with seq < credit
    done: int  # frames this hop has processed and handed on
    result: FrameResult | None = None
    compression: list[Compression] = Field(default_factory=lambda: list(COMPRESSIONS))


class RunEvent(BaseModel):
    """One chunk of a streamed answer (a Decode Run's, or a Step Stream's): a token, or the end.

    Every token comes as `result`; the last event has `end` set (the run stopped: its steps
    ran out, a stop id came, or the caller went away) with the hop's credit, or `failure`
    (the route broke), or `error` (a Step Stream's step was refused)."""

    result: FrameResult | None = None
    end: bool = False
    credit: int | None = None
    done: int | None = None
    failure: RouteFailure | None = None
    error: FrameError | None = None


ErrorCode = Literal[
    "bad_frame",
    "unknown_session",
    "session_closed",
    "session_refused",
    "route_mismatch",
    "epoch_mismatch",
    "hop_mismatch",
    "seq_mismatch",
    "position_mismatch",
    "phase_mismatch",
    "session_busy",
    "no_credit",
    "session_failed",
    "engine_error",
]

ERROR_STATUS: dict[str, int] = {
    "bad_frame": 400,
    "unknown_session": 404,
    "session_closed": 410,
    "session_refused": 409,
    "route_mismatch": 409,
    "epoch_mismatch": 409,
    "hop_mismatch": 409,
    "seq_mismatch": 409,
    "position_mismatch": 409,
    "phase_mismatch": 409,
    "session_busy": 409,
    "no_credit": 429,
    "session_failed": 502,
    "engine_error": 500,
}


# --- the per-token wire path ----------------------------------------------------------------
#
# Every decode step builds and parses a FrameAck on each seam and a RunEvent to the caller.
# Right after a model call has streamed the shard's weights through the caches, a pydantic
# build/serialize/parse costs 55-125 µs each on the 2-core reference VM (5-8 µs warm); these
# hand-written codecs for the same JSON cost a fraction of that. The pydantic models stay the
# contract: tests/test_frames.py checks both directions against them.


WireTiming = dict[str, Any]  # a HopTiming as its JSON object
WireResult = dict[str, Any]  # a FrameResult as its JSON object (result_wire's shape), on the per-token path


def wire_result(token_id: int, position: int, timing: WireTiming, logprob: float | None = None,
                top_logprobs: list[tuple[int, float]] | None = None, sampled_ms: float | None = None) -> WireResult:
    """The tail's token as the JSON object of its FrameResult, built without a model object
    (on the per-token path, right after a model call, each pydantic object costs 40-80 µs)."""
    d: WireResult = {"token_id": token_id, "position": position}
    if logprob is not None:
        d["logprob"] = logprob
    if top_logprobs:
        d["top_logprobs"] = top_logprobs
    if sampled_ms is not None:
        d["sampled_ms"] = sampled_ms
    d["timings"] = [timing]
    return d


def wire_timing(node_id: str, compute_ms: float, handle_ms: float) -> WireTiming:
    """One hop's HopTiming as its JSON object."""
    return {"node_id": node_id, "compute_ms": compute_ms, "handle_ms": handle_ms}


def result_wire(r: FrameResult | WireResult) -> WireResult:
    """A FrameResult as the JSON object its model dumps (None and empty fields left out)."""
    if isinstance(r, dict):
        return r
    d: dict[str, object] = {"token_id": r.token_id, "position": r.position}
    if r.logprob is not None:
        d["logprob"] = r.logprob
    if r.top_logprobs:
        d["top_logprobs"] = r.top_logprobs
    if r.timings:
        d["timings"] = [{"node_id": t.node_id, "compute_ms": t.compute_ms, "handle_ms": t.handle_ms}
                        for t in r.timings]
    if r.sampled_ms is not None:
        d["sampled_ms"] = r.sampled_ms
    return d


def ack_bytes(seq: int, credit: int, done: int, result: FrameResult | WireResult | None = None) -> bytes:
    """The JSON of FrameAck(seq, credit, done, result)."""
    d: dict[str, object] = {"seq": seq, "credit": credit, "done": done}
    if result is not None:
        d["result"] = result_wire(result)
    d["compression"] = COMPRESSIONS
    return orjson.dumps(d)


def run_token_bytes(result: FrameResult | WireResult) -> bytes:
    """The JSON of RunEvent(result=result): one token of a Decode Run."""
    return orjson.dumps({"result": result_wire(result)})


def _int(v: object) -> int:
    if type(v) is not int:
        raise TypeError(f"expected an integer, got {v!r}")
    return v


def _float(v: object) -> float:
    if type(v) not in (int, float):
        raise TypeError(f"expected a number, got {v!r}")
    return float(v)  # type: ignore[arg-type]


def parse_result(d: object) -> FrameResult:
    """A FrameResult from its JSON object, type-checked (TypeError/KeyError on anything else)."""
    if not isinstance(d, dict):
        raise TypeError("a result is a JSON object")
    lp = d.get("logprob")
    at = d.get("sampled_ms")
    return FrameResult.model_construct(
        token_id=_int(d["token_id"]), position=_int(d["position"]),
        logprob=None if lp is None else _float(lp), sampled_ms=None if at is None else _float(at),
        top_logprobs=[(_int(t), _float(p)) for t, p in d.get("top_logprobs", ())],
        timings=[HopTiming.model_construct(node_id=str(t["node_id"]), compute_ms=_float(t["compute_ms"]),
                                           handle_ms=_float(t["handle_ms"])) for t in d.get("timings", ())],
    )


def parse_ack(raw: bytes) -> FrameAck:
    """A FrameAck from its JSON; FrameFormatError if it is not one."""
    try:
        d = orjson.loads(raw)
        if not isinstance(d, dict):
            raise TypeError("an ack is a JSON object")
        r = d.get("result")
        accepted = d.get("compression", COMPRESSIONS)
        return FrameAck.model_construct(
            seq=_int(d["seq"]), credit=_int(d["credit"]), done=_int(d["done"]),
            result=None if r is None else parse_result(r),
            compression=[c for c in COMPRESSIONS if c in accepted],
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise FrameFormatError(f"bad frame ack: {type(exc).__name__}: {exc}") from exc


def _check_wire_result(r: object) -> WireResult:
    """`r` if it is a result's JSON object with what the per-token path uses (token_id,
    position, timings; timings defaulted to []); TypeError/KeyError otherwise."""
    if not isinstance(r, dict):
        raise TypeError("a result is a JSON object")
    _int(r["token_id"])
    _int(r["position"])
    if not isinstance(r.setdefault("timings", []), list):
        raise TypeError("timings is a list")
    return r


def parse_ack_wire(raw: bytes) -> tuple[int, WireResult | None, list[Compression]]:
    """(credit, result as its JSON object, accepted compressions) of a FrameAck's JSON, with
    what the per-token path uses type-checked (token_id, position, timings); the rest of the
    result is checked by whoever parses it into a FrameResult. FrameFormatError otherwise."""
    try:
        d = orjson.loads(raw)
        if not isinstance(d, dict):
            raise TypeError("an ack is a JSON object")
        _int(d["seq"])
        _int(d["done"])
        r = d.get("result")
        if r is not None:
            _check_wire_result(r)
        accepted = d.get("compression", COMPRESSIONS)
        return _int(d["credit"]), r, [c for c in COMPRESSIONS if c in accepted]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise FrameFormatError(f"bad frame ack: {type(exc).__name__}: {exc}") from exc


def parse_step_answer(raw: bytes) -> WireResult | RunEvent:
    """One answer of a Step Stream: a token's result as its JSON object (type-checked as in
    parse_ack_wire), or any other RunEvent (the end, a failure, a refusal). FrameFormatError
    otherwise."""
    try:
        d = orjson.loads(raw)
        if type(d) is dict and len(d) == 1 and "result" in d:
            return _check_wire_result(d["result"])
        event = RunEvent.model_validate(d)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise FrameFormatError(f"bad step answer: {type(exc).__name__}: {exc}") from exc
    if event.result is not None:  # a result sent with other (default) fields: the same checked object
        return _check_wire_result(result_wire(event.result))
    return event


def parse_run_event(raw: bytes) -> RunEvent:
    """A RunEvent from its JSON: tokens on the per-token path, the last event with pydantic."""
    try:
        d = orjson.loads(raw)
        if isinstance(d, dict) and d.keys() == {"result"}:
            return RunEvent.model_construct(result=parse_result(d["result"]))
        return RunEvent.model_validate(d)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise FrameFormatError(f"bad run event: {type(exc).__name__}: {exc}") from exc


class FrameError(BaseModel):
    """A hop's refusal: a typed code, a message, what it expected, and the route failure if any."""

    code: ErrorCode
    message: str
    expected: dict[str, int | str] = Field(default_factory=dict)
    failure: RouteFailure | None = None

    @property
    def status(self) -> int:
        """The HTTP status this error is sent with."""
        return ERROR_STATUS[self.code]


RunEvent.model_rebuild()  # its `error` field names FrameError, defined after it


class CreditGrant(BaseModel):
    """Reply of the credit long-poll GET /v1/sessions/<id>/credit."""

    credit: int
    done: int


class FrameFormatError(ValueError):
    """A frame header or body that does not parse or does not match its header."""


class RouteFailedError(Exception):
    """A Route Session failed; `failure` names the phase, the hop and the reason."""

    def __init__(self, failure: RouteFailure) -> None:
        hop = "" if failure.hop_index is None else f" at hop {failure.hop_index} ({failure.node_id})"
        super().__init__(f"route {failure.route_id} failed in {failure.phase}{hop}: {failure.reason}")
        self.failure = failure


class FrameRejectedError(Exception):
    """A hop answered a frame with a FrameError (4xx/5xx)."""

    def __init__(self, status: int, error: FrameError) -> None:
        super().__init__(f"{status} {error.code}: {error.message}")
        self.status = status
        self.error = error


class HopUnreachableError(Exception):
    """The hop could not be reached or dropped the connection (refused, reset, closed)."""

    def __init__(self, hop_index: int, node_id: str, reason: str) -> None:
        super().__init__(f"hop {hop_index} ({node_id}) unreachable: {reason}")
        self.hop_index = hop_index
        self.node_id = node_id
        self.reason = reason


# --- body codec (pure) -------------------------------------------------------------------

_ZSTD_C = zstandard.ZstdCompressor(level=1)
_ZSTD_D = zstandard.ZstdDecompressor()


def _to_bf16(rows: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype("<u2")


def _from_bf16(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_rows(rows: np.ndarray, dtype: WireDtype, compression: Compression = "none") -> bytes:
    """Serialize token ids [n] or hidden rows [n, width] as little-endian `dtype` bytes."""
    if dtype == "i32":
        raw = np.ascontiguousarray(rows, dtype="<i4").tobytes()
    elif dtype == "f32":
        raw = np.ascontiguousarray(rows, dtype="<f4").tobytes()
    elif dtype == "f16":
        raw = np.ascontiguousarray(rows, dtype="<f2").tobytes()
    else:
        raw = _to_bf16(rows).tobytes()
    return _ZSTD_C.compress(raw) if compression == "zstd" else raw


_LITTLE_ENDIAN = sys.byteorder == "little"


def decode_rows(header: FrameHeader, body: bytes) -> np.ndarray:
    """Parse a frame body: int32 [n] for token ids, float32 [n, width] for hidden rows."""
    size = header.raw_size
    if header.compression == "zstd":
        try:
            body = _ZSTD_D.decompress(body, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise FrameFormatError(f"bad zstd body: {exc}") from exc
    if len(body) != size:
        raise FrameFormatError(f"body has {len(body)} bytes, header says {size}")
    if header.dtype == "i32":
        if header.width != 1:
            raise FrameFormatError("token-id frames have width 1")
        return np.frombuffer(body, dtype="<i4").astype(np.int32)
    shape = (header.n_rows, header.width)
    if header.dtype == "f32":  # already float32 on a little-endian host: no astype call per step
        rows = np.frombuffer(body, dtype="<f4").reshape(shape)
        return rows if _LITTLE_ENDIAN else rows.astype(np.float32)
    if header.dtype == "f16":
        return np.frombuffer(body, dtype="<f2").reshape(shape).astype(np.float32)
    return _from_bf16(np.frombuffer(body, dtype="<u2")).reshape(shape)


# --- credit accounting (pure) --------------------------------------------------------------


def credit_limit(done: int, window: int) -> int:
    """Cumulative credit a receiver grants: frames with seq < done + window may be sent."""
    return done + window


def has_credit(seq: int, credit: int) -> bool:
    """Whether frame `seq` may be sent under a cumulative credit limit."""
    return seq < credit


def choose_compression(preferred: Compression, accepted: list[Compression]) -> Compression:
    """The sender's compression for a hop: its preference if the receiver accepts it."""
    return preferred if preferred in accepted else "none"


def wire_request_bytes(method: str, path_qs: str, raw_headers: list[tuple[bytes, bytes]], body: int) -> int:
    """Bytes of an HTTP/1.1 request as sent: request line, header lines, blank line, body."""
    line = len(method) + 1 + len(path_qs) + len(" HTTP/1.1\r\n")
    return line + sum(len(k) + len(v) + 4 for k, v in raw_headers) + 2 + body


# --- the sending side of one seam ----------------------------------------------------------


@dataclass(slots=True)
class LinkStats:
    """What a FrameLink has sent: frames, body bytes, and the most frames awaiting credit."""

    frames: int = 0
    body_bytes: int = 0
    credit_waits: int = 0


class FrameTransportError(Exception):
    """The connection to a hop failed before a complete response arrived."""


class H1Connection:
    """One keep-alive HTTP/1.1 connection to a hop: the frame plane's only transport.

    A seam sends one request at a time and needs no more than Content-Length bodies, so a
    small asyncio Protocol replaces a general client: the request goes out in one write and
    the response is parsed where its bytes arrive, waking the caller once (measured: about
    250 µs less per frame than an aiohttp ClientSession request, and less again than asyncio
    streams, on the 2-core reference VM)."""

    def __init__(self, base_url: str, *, connect_timeout: float = 2.0) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"activation URL must be http://host:port, got {base_url!r}")
        self.host = url.hostname
        self.port = url.port or 80
        self.connect_timeout = connect_timeout
        self._prefix = f"Host: {self.host}:{self.port}\r\n"
        self._proto: _ResponseReader | None = None
        self.connects = 0

    async def _connect(self) -> _ResponseReader:
        self.connects += 1
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            _, proto = await loop.create_connection(_ResponseReader, self.host, self.port)
        self._proto = proto
        return proto

    async def request(self, method: str, path_qs: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
        """Send one request, return (status, body). Retries once if a reused connection was stale."""
        status, answer = await self.stream(method, path_qs, headers, body)
        if isinstance(answer, ChunkStream):  # a streamed answer nobody asked for: collect it
            return status, b"".join([c async for c in answer])
        return status, answer

    async def stream(self, method: str, path_qs: str, headers: dict[str, str],
                     body: bytes = b"", *, chunked: bool = False) -> tuple[int, bytes | ChunkStream]:
        """Send one request; a chunked answer comes back as a ChunkStream to iterate, any other
        as its whole body. Leaving the stream before its end closes the connection.

        `chunked`: the request's body is chunked and stays open: `body` is its first chunk,
        send_chunk adds more and end_body ends it (a Step Stream)."""
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if chunked:
            length, body = "Transfer-Encoding: chunked", encode_chunks([body])
        else:
            length = f"Content-Length: {len(body)}"
        head = f"{method} {path_qs} HTTP/1.1\r\n{self._prefix}{lines}{length}\r\n\r\n".encode()
        for attempt in (0, 1):
            proto = self._proto
            reused = proto is not None and proto.open
            try:
                if not reused:
                    self.close()
                    proto = await self._connect()
                assert proto is not None
                return await proto.exchange(head, body)
            except _StaleConnection:
                self.close()
                if attempt or not reused:
                    raise FrameTransportError("connection closed before any response") from None
            except (OSError, ValueError) as exc:
                self.close()
                raise FrameTransportError(f"{type(exc).__name__}: {exc}") from exc
            except TimeoutError as exc:
                self.close()
                raise FrameTransportError(f"connect timed out after {self.connect_timeout}s") from exc
            except asyncio.CancelledError:
                self.close()  # a response may still arrive for this request: never reuse the connection
                raise
        raise FrameTransportError("unreachable")  # pragma: no cover

    def send_chunk(self, payload: bytes) -> bool:
        """One more chunk of the open chunked request body; False if the connection is gone."""
        proto = self._proto
        if proto is None or not proto.open or proto.transport is None:
            return False
        proto.transport.write(encode_chunks((payload,)))
        return True

    def end_body(self) -> bool:
        """End the open chunked request body; False if the connection is gone."""
        proto = self._proto
        if proto is None or not proto.open or proto.transport is None:
            return False
        proto.transport.write(LAST_CHUNK)
        return True

    def close(self) -> None:
        """Drop the connection (the next request opens a new one)."""
        if self._proto is not None:
            self._proto.close()
        self._proto = None


class _StaleConnection(Exception):
    """The peer closed the connection before answering (a stale keep-alive, or a dead hop)."""


class ChunkStream:
    """The body of one chunked HTTP response, chunk by chunk, as it arrives.

    Iterate it to the end; stopping early (break, cancel, error) closes the connection, since
    the rest of the answer would otherwise be read as the next request's. A chunk that comes
    while the reader waits resolves its waiter directly (no queue: the per-token path runs
    right after a model call, on cold caches, where every Python call counts)."""

    def __init__(self, reader: _ResponseReader) -> None:
        self._reader = reader
        self._items: deque[bytes | BaseException | None] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.ended = False

    def _put(self, item: bytes | BaseException | None) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    @property
    def buffered(self) -> int:
        """Chunks already received and not yet read (the end counts as one)."""
        return len(self._items)

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> bytes:
        if self.ended:
            raise StopAsyncIteration
        if not self._items:
            self._waiter = w = asyncio.get_running_loop().create_future()
            try:
                await w
            except BaseException:
                self._waiter = None
                self.abandon()
                raise
        item = self._items.popleft()
        if item is None:
            self.ended = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.ended = True
            raise FrameTransportError(f"{type(item).__name__}: {item}") from item
        return item

    def abandon(self) -> None:
        """Stop reading before the end: the connection is closed (the sender sees it go)."""
        if not self.ended:
            self.ended = True
            self._reader.close()


class _ResponseReader(asyncio.Protocol):
    """The client side of one connection: writes a request, parses its response as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes | ChunkStream]] | None = None
        self._stream: ChunkStream | None = None  # the chunked answer being read
        self.open = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        stream, self._stream = self._stream, None
        if stream is not None:
            stream._put(ConnectionResetError(f"connection closed mid-stream: {exc or 'EOF'}"))
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            if self._buf:
                w.set_exception(ConnectionResetError(f"connection closed mid-response: {exc or 'EOF'}"))
            else:
                w.set_exception(_StaleConnection())

    def exchange(self, head: bytes, body: bytes) -> asyncio.Future[tuple[int, bytes | ChunkStream]]:
        """Write one request; the future resolves with its (status, body or ChunkStream)."""
        assert self.transport is not None and self._waiter is None and self._stream is None
        fut: asyncio.Future[tuple[int, bytes | ChunkStream]] = asyncio.get_running_loop().create_future()
        self._waiter = fut
        self._buf.clear()
        if len(body) < 65536:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))
        return fut

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._stream is not None:
            self._read_chunks()
            return
        w = self._waiter
        if w is None:
            return  # bytes nobody asked for: the next exchange discards them
        try:
            parsed = _parse_response(self._buf)
        except ValueError as exc:
            self._waiter = None
            w.set_exception(exc)
            self.close()
            return
        if parsed is None:
            return
        self._waiter = None
        status, body, chunked = parsed
        if not chunked:
            if not w.done():
                w.set_result((status, body))
            return
        self._stream = ChunkStream(self)
        if not w.done():
            w.set_result((status, self._stream))
        self._read_chunks()

    def _read_chunks(self) -> None:
        while (stream := self._stream) is not None:
            try:
                chunk = take_chunk(self._buf)
            except ValueError as exc:
                self._stream = None
                stream._put(exc)
                self.close()
                return
            if chunk is None:
                return
            if chunk:
                stream._put(chunk)
            else:  # the last chunk: the connection is free for the next request
                self._stream = None
                stream._put(None)

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()


def _parse_response(buf: bytearray) -> tuple[int, bytes, bool] | None:
    """Take one HTTP/1.1 response head (and its Content-Length body) off the front of `buf`,
    skipping 1xx; None until complete. A chunked answer returns (status, b"", True) once its
    head is in: its chunks follow (take_chunk)."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEADER_BYTES * 4:
                raise ValueError("response head too large")
            return None
        status_line, _, rest = bytes(buf[:end]).partition(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"malformed status line {status_line[:60]!r}")
        status = int(parts[1])
        if 100 <= status < 200:  # an interim response (100 Continue): the real one follows
            del buf[:end + 4]
            continue
        length, chunked = 0, False
        for line in rest.split(b"\r\n"):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
        if chunked:
            del buf[:end + 4]
            return status, b"", True
        total = end + 4 + length
        if len(buf) < total:
            return None
        body = bytes(buf[end + 4:total])
        del buf[:total]
        return status, body, False


_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")


def take_chunk(buf: bytearray, max_size: int | None = None) -> bytes | None:
    """Take one chunk of a chunked HTTP body off the front of `buf`: its payload, b"" for the
    last chunk, None until it is complete (trailers are not used on this plane). ValueError
    on a malformed chunk, or one announcing more than `max_size` bytes."""
    eol = buf.find(b"\r\n")
    if eol < 0:
        if len(buf) > 64:
            raise ValueError("chunk size line too long")
        return None
    size_text = bytes(buf[:eol]).split(b";", 1)[0]
    if _CHUNK_SIZE.fullmatch(size_text) is None:  # hex digits only: no sign, 0x, spaces or _ (smuggling)
        raise ValueError(f"bad chunk size {size_text[:20]!r}")
    size = int(size_text, 16)
    if max_size is not None and size > max_size:
        raise ValueError(f"a chunk of {size} bytes (at most {max_size} expected)")
    end = eol + 2 + size + 2
    if len(buf) < end:
        return None
    if buf[end - 2:end] != b"\r\n":
        raise ValueError("chunk not terminated by CRLF")
    payload = bytes(buf[eol + 2:end - 2])
    del buf[:end]
    return payload


def encode_chunks(payloads: Sequence[bytes]) -> bytes:
    """Each payload as one chunk of a chunked HTTP body."""
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in payloads)


LAST_CHUNK = b"0\r\n\r\n"


class FrameLink:
    """Sends one session's frames to one hop in order, obeying that hop's credit."""

    def __init__(
        self,
        base_url: str,
        *,
        hop_index: int,
        node_id: str,
        session_id: str,
        route_id: str,
        epoch: int,
    ) -> None:
        self.conn = H1Connection(base_url)
        self.hop_index = hop_index
        self.node_id = node_id
        self.session_id = session_id
        self.route_id = route_id
        self.epoch = epoch
        self.credit = 1  # every receiver admits frame 0; later grants come with each ack
        self.accepted: list[Compression] = ["none"]
        self.stats = LinkStats()
        self._credit_path = f"{SESSIONS_PATH}/{session_id}/credit?route_id={route_id}&epoch={epoch}&above="
        self._run_stream: ChunkStream | None = None  # the Decode Run being read
        self._steps: ChunkStream | None = None  # the open Step Stream's answers
        self._ending: ChunkStream | None = None  # a Step Stream whose end has not been read yet

    async def _request(self, method: str, path_qs: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
        await self._settle()
        try:
            return await self.conn.request(method, path_qs, headers, body)
        except FrameTransportError as exc:
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc

    async def _post_frame(self, seq: int, header: str, body: bytes, *, stream: bool = False,
                          chunked: bool = False) -> tuple[int, bytes | ChunkStream]:
        """Wait for credit, then POST one frame (its answer streamed if `stream`; a chunked
        body, `body` its first chunk, if `chunked`)."""
        await self._settle()
        if not has_credit(seq, self.credit):
            await self.wait_credit(seq)
        headers = {FRAME_HEADER: header, "Content-Type": "application/octet-stream"}
        try:
            if stream:
                answer: tuple[int, bytes | ChunkStream] = await self.conn.stream(
                    "POST", FRAMES_PATH, headers, body, chunked=chunked)
            else:
                answer = await self.conn.request("POST", FRAMES_PATH, headers, body)
        except FrameTransportError as exc:
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
        self.stats.frames += 1
        self.stats.body_bytes += len(body)
        return answer

    async def wait_credit(self, seq: int) -> None:
        """Block until the hop grants credit for frame `seq` (long-polls its credit)."""
        while not has_credit(seq, self.credit):
            self.stats.credit_waits += 1
            status, raw = await self._request("GET", f"{self._credit_path}{self.credit}", {})
            if status != 200:
                raise FrameRejectedError(status, _parse_error(status, raw))
            self.credit = max(self.credit, CreditGrant.model_validate_json(raw).credit)

    async def send(self, header: FrameHeader, body: bytes) -> FrameAck:
        """Wait for credit, POST the frame and return the hop's ack (raises typed errors)."""
        return await self.send_rendered(header.seq, header.to_header(), body)

    async def send_rendered(self, seq: int, header: str, body: bytes) -> FrameAck:
        """send() for a header already rendered (FrameHeader.to_header, StepHeaders.render)."""
        status, raw = await self._post_frame(seq, header, body)
        assert isinstance(raw, bytes)  # request() collects any stream
        if status >= 300:
            raise FrameRejectedError(status, _parse_error(status, raw))
        try:
            ack = parse_ack(raw)
        except FrameFormatError as exc:
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
        self.credit = max(self.credit, ack.credit)
        self.accepted = list(ack.compression)
        return ack

    async def send_step(self, seq: int, header: str, body: bytes) -> WireResult:
        """send_rendered() for a final decode step on the per-token path: the tail's result as
        its JSON object (parse_ack_wire), no model objects."""
        status, raw = await self._post_frame(seq, header, body)
        assert isinstance(raw, bytes)
        if status >= 300:
            raise FrameRejectedError(status, _parse_error(status, raw))
        try:
            credit, result, accepted = parse_ack_wire(raw)
            if result is None:
                raise FrameFormatError("a final frame's ack has no result")
        except FrameFormatError as exc:
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
        self.credit = max(self.credit, credit)
        self.accepted = accepted
        return result

    async def stream_step(self, seq: int, header: Callable[[], str], body: bytes,
                          after_send: Callable[[], None] | None = None) -> WireResult:
        """One decode step of a Decode Run over this seam's Step Stream; the tail's result as
        its JSON object. The first step opens the stream (one POST whose chunked body stays
        open; `header()` is that step's FrameHeader, with `stream` set); each later step is one
        more chunk of it and one more chunk of the answer. end_stream ends it. `after_send`
        runs once the step's rows are written (work that can overlap the next hop's). Raises
        typed errors, like send_step; after one the stream is gone (the next step opens a new one)."""
        steps = self._steps
        if steps is None:
            status, answer = await self._post_frame(seq, header(), body, stream=True, chunked=True)
            if not isinstance(answer, ChunkStream):
                self.conn.close()  # the request's chunked body was never ended: the connection cannot carry another
                if status >= 300:
                    raise FrameRejectedError(status, _parse_error(status, answer))
                raise HopUnreachableError(self.hop_index, self.node_id, "a Step Stream got no streamed answer")
            self._steps = steps = answer
        else:
            if not self.conn.send_chunk(body):
                self._steps = None
                raise HopUnreachableError(self.hop_index, self.node_id, "the Step Stream's connection is closed")
            self.stats.frames += 1
            self.stats.body_bytes += len(body)
        if after_send is not None:
            after_send()
        try:
            answer_raw = await steps.__anext__()
            outcome = parse_step_answer(answer_raw)
        except BaseException as exc:  # cancelled, cut short or garbled: the stream cannot go on
            self._steps = None
            steps.abandon()
            if isinstance(exc, StopAsyncIteration):
                raise HopUnreachableError(self.hop_index, self.node_id, "the Step Stream ended early") from None
            if isinstance(exc, (FrameTransportError, FrameFormatError)):
                raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
            raise
        if isinstance(outcome, dict):
            self.credit = max(self.credit, seq + 2)  # done > seq and the window is at least 1
            return outcome
        self._steps = None
        steps.abandon()  # the hop ends its answer after a refusal or failure, and closes
        if outcome.error is not None:
            raise FrameRejectedError(outcome.error.status, outcome.error)
        if outcome.failure is not None:
            err = FrameError(code="session_failed", message=outcome.failure.reason, failure=outcome.failure)
            raise FrameRejectedError(err.status, err)
        raise HopUnreachableError(self.hop_index, self.node_id, "the Step Stream ended before its step's answer")

    def end_stream(self) -> None:
        """End the open Step Stream, if any, without waiting: its last answer (the hop's end,
        with its credit) is read before this link's next request."""
        steps, self._steps = self._steps, None
        if steps is not None and self.conn.end_body():
            self._ending = steps
        elif steps is not None:
            steps.abandon()

    async def _settle(self) -> None:
        """Read the end of a Step Stream ended earlier, so its connection can carry the next
        request; a hop that does not end it within STREAM_END_S loses the connection."""
        steps, self._ending = self._ending, None
        if steps is None:
            return
        try:
            async with asyncio.timeout(STREAM_END_S):
                async for raw in steps:
                    event = parse_step_answer(raw)
                    if isinstance(event, RunEvent) and event.credit is not None:
                        self.credit = max(self.credit, event.credit)
        except (TimeoutError, FrameTransportError, FrameFormatError):
            steps.abandon()
            self.conn.close()

    async def run(self, header: FrameHeader, body: bytes) -> AsyncIterator[RunEvent]:
        """POST a Decode Run frame and yield the head's RunEvents as they arrive, the last one
        with `end` or `failure` (raises typed errors; leaving early closes the connection)."""
        status, answer = await self._post_frame(header.seq, header.to_header(), body, stream=True)
        if not isinstance(answer, ChunkStream):
            if status >= 300:
                raise FrameRejectedError(status, _parse_error(status, answer))
            raise FrameRejectedError(502, FrameError(code="bad_frame", message="a Decode Run got no stream"))
        last: RunEvent | None = None
        self._run_stream = answer
        try:
            async for chunk in answer:
                event = parse_run_event(chunk)
                if event.credit is not None:
                    self.credit = max(self.credit, event.credit)
                if event.end or event.failure is not None:
                    last = event  # read the stream's end first, so the connection stays usable
                    continue
                yield event
        except (FrameTransportError, FrameFormatError) as exc:
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
        finally:
            self._run_stream = None
            answer.abandon()  # no-op after the last chunk
        if last is None:
            raise HopUnreachableError(self.hop_index, self.node_id, "the Decode Run's stream ended without its last event")
        yield last

    @property
    def run_buffered(self) -> int:
        """RunEvents of the Decode Run in progress that arrived and were not read yet."""
        return 0 if self._run_stream is None else self._run_stream.buffered

    def close(self) -> None:
        """Close the link's connection (and any Step Stream on it)."""
        self._steps = self._ending = None
        self.conn.close()


def _parse_error(status: int, raw: bytes) -> FrameError:
    try:
        return FrameError.model_validate_json(raw)
    except ValidationError:
        text = raw[:200].decode("utf-8", "replace")
        code: ErrorCode = "session_failed" if status >= 500 else "bad_frame"
        return FrameError(code=code, message=f"HTTP {status}: {text}")


def failure_from_rejection(
    exc: FrameRejectedError, *, session_id: str, route_id: str, phase: Phase, hop_index: int, node_id: str
) -> RouteFailure:
    """The RouteFailure a rejection means: the hop's own failure if it sent one, else one naming it."""
    if exc.error.failure is not None:
        return exc.error.failure
    return RouteFailure(
        session_id=session_id,
        route_id=route_id,
        phase=phase,
        hop_index=hop_index,
        node_id=node_id,
        reason=f"{exc.error.code}: {exc.error.message}",
        code=exc.error.code,
    )


def failure_from_unreachable(
    exc: HopUnreachableError, *, session_id: str, route_id: str, phase: Phase
) -> RouteFailure:
    """The RouteFailure for a hop that could not be reached or dropped the connection."""
    return RouteFailure(
        session_id=session_id,
        route_id=route_id,
        phase=phase,
        hop_index=exc.hop_index,
        node_id=exc.node_id,
        reason=f"hop unreachable: {exc.reason}",
        code="hop_lost",
    )


_HEADER_DEFAULTS = {name: f.default for name, f in FrameHeader.model_fields.items()}
