"""Activation frames: the contracts of the binary HTTP data plane between a caller and the
hops of a route (the transport that carries them is wire/).

One frame is one HTTP POST to `<activation_url>/v1/frames`. Its typed header travels as
compact JSON in the `x-meshnet-frame` HTTP header, so a hop validates session, route, epoch,
sequence, position, credential and credit before it reads the body or runs its model. The
body is raw little-endian rows: int32 token ids into a head shard, f32/f16/bf16 hidden rows
across a seam, optionally zstd level 1. Replies are small JSON: a FrameAck (credit, and the
tail's FrameResult for a final frame) or a FrameError (typed code, and a RouteFailure on 502).

A Decode Run (every decode frame is one, sent to the head; `steps` its most tokens) lets the head drive the
decode loop itself: it feeds each token the tail returns back into its own shard, and
streams every token to the caller as one chunk of a chunked HTTP response (RunEvent JSON),
so the caller is off the per-token path. With `flush_ms` the head holds tokens and writes
them together at most that often (the first token and the run's end at once), so the caller
is woken once per batch instead of once per token.

Past the head, a run's steps cross each seam as one lane of a Seam Link (a FrameHeader with
`stream`): one long POST per pair of nodes whose chunked body carries, per chunk, the steps of
every session one iteration produced, each lane's step answered by one event of the chunked
answer, so a step costs no request head, header validation or admission (wire.link.FrameLink.
stream_step / end_stream, wire.seam_link; the receiver is nodes/server/seam_link.py). On a route
of 3 or more hops the steps go `direct`: the head opens a Return Stream on its Seam Link to the
tail (a LANE_RETURN lane) and the tail writes each token there, so a token crosses one seam back
instead of every middle hop (docs/activation-protocol.md, "Direct return").
See docs/activation-protocol.md.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import orjson
import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.route import RouteFailure

FRAME_HEADER = "x-meshnet-frame"
FRAMES_PATH = "/v1/frames"
LINKS_PATH = "/v1/links"  # POST, chunked both ways: a Seam Link (below)
SESSIONS_PATH = "/v1/sessions"
MAX_ROWS = 4096  # rows per frame; bounds a frame body before it is read
MAX_HEADER_BYTES = 4096
DEFAULT_CHUNK_SIZE = 64  # prompt tokens per prefill frame across machines: small chunks pipeline the hops
COLOCATED_CHUNK_SIZE = 512  # hops sharing one machine's cores: one hop at a time, each with every core
DEFAULT_WINDOW = 4  # frames a receiver buffers beyond what it has processed
CREDIT_POLL_S = 5.0  # longest a credit long-poll is held before it answers "no change"
MAX_RUN_STEPS = 1 << 20  # decode steps one Decode Run may ask for (the context bounds it first)
MAX_STOP_IDS = 256
MAX_DRAFT = 8  # most drafted tokens one verify step carries (speculative decoding, nodes/speculation.py)
MAX_RUN_FLUSH_MS = 1000  # longest a Decode Run may hold its tokens before writing them
RUN_CONTENT_TYPE = "application/x-ndjson"
STREAM_END_S = 5.0  # longest a sender waits for a lane's last answer before it lets the lane go

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
    steps: int = Field(default=1, ge=1, le=MAX_RUN_STEPS)  # a Decode Run's most tokens (every decode frame is one)
    stop_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_IDS)  # a run ends on these tokens
    flush_ms: int = Field(default=0, ge=0, le=MAX_RUN_FLUSH_MS)  # a run writes held tokens at most this often
    stream: bool = False  # a lane's header: one decode step per Seam Link part from this seq and position
    # a lane whose tokens the tail sends straight to the head over its Return Stream
    # (direct return): no hop answers a step on the stream itself, only its end or a failure
    direct: bool = False
    stepwise: bool = False  # prefill: every row runs as a model call of its own, as decode steps did (a restart's replay)
    # speculative decoding: a Decode Run's most drafted tokens per step; on a lane, each
    # chunk is a step of its own position with up to this many drafts (step_chunk)
    draft: int = Field(default=0, ge=0, le=MAX_DRAFT)

    @property
    def is_run(self) -> bool:
        """Whether this frame asks the head for a Decode Run (a streamed answer): every decode
        frame does (one step is a run of one); a lane's steps are not frames."""
        return self.phase == "decode" and not self.stream

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
    """The headers of one seam's decode steps (a lane's), which differ only in seq and position.

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
    # a verify step's tokens: the tail's answer says how many tokens the head drafted and how
    # many of them it kept (each kept draft reaches the caller as a result of its own, before
    # the step's token); the head moves both to the step's first token for the caller
    drafted: int = 0
    accepted: int = 0
    drafts: list[FrameResult] = Field(default_factory=list)  # the tail's kept drafts, to the head only
    pipelined: bool = False  # that verify step (with drafts) left the head before the one before it was answered


class FrameAck(BaseModel):
    """A hop accepted (and for a final frame, completed) frame `seq`; it grants new credit."""

    seq: int
    credit: int  # cumulative: the sender may send frames with seq < credit
    done: int  # frames this hop has processed and handed on
    result: FrameResult | None = None
    compression: list[Compression] = Field(default_factory=lambda: list(COMPRESSIONS))


class RunEvent(BaseModel):
    """One chunk of a streamed answer (a Decode Run's, or a lane's): a token, or the end.

    Every token comes as `result`; the last event has `end` set (the run stopped: its steps
    ran out, a stop id came, or the caller went away) with the hop's credit, or `failure`
    (the route broke), or `error` (a lane's step was refused)."""

    result: FrameResult | None = None
    end: bool = False
    credit: int | None = None
    done: int | None = None
    failure: RouteFailure | None = None
    error: FrameError | None = None


ErrorCode = Literal[
    "bad_frame",
    "bad_credential",
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
    "bad_credential": 401,
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
# build/serialize/parse is slow (docs/benchmarks.md, "Notes moved out of code comments"); these
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
    if r.drafted:
        d["drafted"] = r.drafted
        d["accepted"] = r.accepted
    if r.drafts:
        d["drafts"] = [result_wire(x) for x in r.drafts]
    if r.pipelined:
        d["pipelined"] = True
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
        drafted=_int(d.get("drafted", 0)), accepted=_int(d.get("accepted", 0)),
        drafts=[parse_result(x) for x in d.get("drafts", ())], pipelined=d.get("pipelined") is True,
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
    """One answer of a lane: a token's result as its JSON object (type-checked as in
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


def decode_rows(header: FrameHeader, body: bytes, n_rows: int | None = None) -> np.ndarray:
    """Parse a frame body: int32 [n] for token ids, float32 [n, width] for hidden rows (`n_rows`:
    a speculative lane's step, whose rows its prefix gives, else the header's)."""
    n = header.n_rows if n_rows is None else n_rows
    size = n * header.width * _ITEMSIZE[header.dtype]
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
    shape = (n, header.width)
    if header.dtype == "f32":  # already float32 on a little-endian host: no astype call per step
        rows = np.frombuffer(body, dtype="<f4").reshape(shape)
        return rows if _LITTLE_ENDIAN else rows.astype(np.float32)
    if header.dtype == "f16":
        return np.frombuffer(body, dtype="<f2").reshape(shape).astype(np.float32)
    return _from_bf16(np.frombuffer(body, dtype="<u2")).reshape(shape)


# --- a speculative lane's steps -------------------------------------------------------------
#
# On a lane whose header has `draft` > 0, each step's part starts with STEP_PREFIX: the step's
# position (a step may start back inside an earlier verify step, dropping what the tail did not
# keep), its guess (the token id the head assumed the step before would end with: a pipelined
# step sent before that step's answer; -1: a step sent after it), and how many drafted tokens it
# carries, then their ids (int32), then the step's 1 + drafts rows. The tail voids a guessed
# step whose position or first token is not what the step before it made (void_result), and
# answers it without running it. At most SPEC_DEPTH steps of one lane are in flight.

STEP_PREFIX = struct.Struct("<IiB3x")
SPEC_DEPTH = 3  # the most verify steps of one speculative lane in flight (a hop's lane window)
DEFAULT_VERIFY_DEPTH = 2  # how many a head sends (meshnet node --verify-depth)


def step_chunk(position: int, drafts: Sequence[int], rows: bytes, guess: int = -1) -> bytes:
    """One step's payload on a speculative lane."""
    return STEP_PREFIX.pack(position, guess, len(drafts)) + np.asarray(drafts, dtype="<i4").tobytes() + rows


def parse_step_chunk(header: FrameHeader, payload: bytes) -> tuple[int, int, list[int], np.ndarray]:
    """(position, guess, drafted ids, rows) of a speculative lane's step; FrameFormatError if
    it is not one the stream's header allows."""
    if len(payload) < STEP_PREFIX.size:
        raise FrameFormatError("a speculative step's chunk starts with its position, guess and draft count")
    position, guess, n = STEP_PREFIX.unpack_from(payload)
    if n > header.draft:
        raise FrameFormatError(f"a step carries at most {header.draft} drafted tokens, got {n}")
    if guess < -1:
        raise FrameFormatError(f"a step's guess is a token id or -1, got {guess}")
    start = STEP_PREFIX.size + 4 * n
    if len(payload) < start:
        raise FrameFormatError("a speculative step's chunk is shorter than its drafts")
    drafts = np.frombuffer(payload, dtype="<i4", count=n, offset=STEP_PREFIX.size).tolist()
    return position, guess, drafts, decode_rows(header, payload[start:], 1 + n)


# --- a direct lane's hop timings ------------------------------------------------------------
#
# On a direct lane (direct return, 3+ hops) the tail's answer skips the middle hops on its way to
# the head, so each step carries their timings forward: its part starts with UPSTREAM_COUNT (how
# many), then per middle hop it passed UPSTREAM_TIMING (its hop index, compute ms, handle ms: from
# the step's arrival to its rows leaving), then the step's own payload. The tail puts them in its
# answer's timings between the head's and its own, so every FrameResult names every hop.

UPSTREAM_COUNT = struct.Struct("<B")
UPSTREAM_TIMING = struct.Struct("<Hff")
HopMark = tuple[int, float, float]  # a middle hop's (hop index, compute_ms, handle_ms) on a direct lane


def upstream_chunk(marks: Sequence[HopMark], payload: bytes) -> bytes:
    """A direct lane's step: the middle hops' timings so far, then the step's payload."""
    return b"".join([UPSTREAM_COUNT.pack(len(marks)), *(UPSTREAM_TIMING.pack(*m) for m in marks), payload])


def split_upstream(payload: bytes, hop: int) -> tuple[list[HopMark], bytes]:
    """(the middle hops' timings, the step's payload) of a direct lane's step arriving at hop
    `hop`; FrameFormatError unless they name the middle hops before it, 1 to hop - 1, in order."""
    n = payload[0] if payload else -1
    start = UPSTREAM_COUNT.size + n * UPSTREAM_TIMING.size
    if n != max(hop - 1, 0) or len(payload) < start:
        raise FrameFormatError(f"a direct lane's step at hop {hop} starts with {max(hop - 1, 0)} hop timings")
    marks = [UPSTREAM_TIMING.unpack_from(payload, UPSTREAM_COUNT.size + i * UPSTREAM_TIMING.size) for i in range(n)]
    if [m[0] for m in marks] != list(range(1, hop)):
        raise FrameFormatError(f"a direct lane's step at hop {hop} names hops {[m[0] for m in marks]}")
    return marks, payload[start:]


def void_result(position: int) -> WireResult:
    """The tail's answer to a guessed step it voided (the step before it did not end as guessed):
    no token; the head already knows, and skips it."""
    return {"token_id": -1, "position": position, "void": True, "timings": []}


def max_step_bytes(header: FrameHeader, slack: int) -> int:
    """The most bytes one step of a lane with `header` may carry (`slack`: what zstd may add)."""
    marks = UPSTREAM_COUNT.size + max(header.hop - 1, 0) * UPSTREAM_TIMING.size if header.direct else 0
    if not header.draft:
        return marks + header.raw_size + slack
    rows = (1 + header.draft) * header.width * _ITEMSIZE[header.dtype]
    return marks + STEP_PREFIX.size + 4 * header.draft + rows + slack


# --- a Seam Link's messages ----------------------------------------------------------------
#
# One long-lived POST /v1/links per pair of consecutive hops' nodes carries the decode steps of
# every session routed that way (docs/activation-protocol.md, "Seam Links"). Each chunk of its
# body is one message: the parts one iteration of the sender produced, each LINK_PART (lane,
# kind, length) then its data. A lane is one session's Decode Run on the link: LANE_OPEN carries
# the run's FrameHeader (as the x-meshnet-frame header would), the hop's credential and the first
# step's payload; LANE_STEP one more step's payload (the rows, or a speculative step's chunk);
# LANE_END ends the lane; with data (LANE_LOST: the index of a hop, 2 bytes) it says the lane's
# feed was lost, the link from that hop to the next having broken mid-run (a receiver that
# reads no data in an end just ends the lane). LANE_RETURN opens a Return Stream instead (from a route's head to its
# tail: the tail's tokens of a run on 3+ hops come back as its events): a ReturnRequest's JSON
# and the tail's credential, no step. Each chunk of the answer is one lane's event: LINK_ANSWER (lane, last)
# then a RunEvent's JSON; `last` ends the lane on the answer side.

LINK_PART = struct.Struct("<IBI")
LANE_OPEN, LANE_STEP, LANE_END, LANE_RETURN = 1, 2, 3, 4
LANE_OPEN_PREFIX = struct.Struct("<HH")  # the header's and the credential's lengths
LANE_LOST = struct.Struct("<H")  # a LANE_END's data when the lane's feed was lost: the hop before the broken link
LINK_ANSWER = struct.Struct("<IB")
MAX_LINK_MESSAGE = 4 << 20  # bytes of one message at most (a sender splits a larger turn's parts)


def link_part(lane: int, kind: int, data: bytes = b"") -> bytes:
    """One part of a Seam Link message."""
    return LINK_PART.pack(lane, kind, len(data)) + data


def lane_open(lane: int, header: str, credential: str, step: bytes, kind: int = LANE_OPEN) -> bytes:
    """The part that opens a lane: the run's header, the hop's credential, the first step (a
    LANE_RETURN: a ReturnRequest's JSON, the tail's credential, no step)."""
    h, c = header.encode(), credential.encode()
    return link_part(lane, kind, LANE_OPEN_PREFIX.pack(len(h), len(c)) + h + c + step)


def lost_hop_of(end_data: bytes) -> int | None:
    """The hop a LANE_END's data names as the one whose link broke (None: an ordinary end)."""
    if len(end_data) != LANE_LOST.size:
        return None
    (hop,) = LANE_LOST.unpack(end_data)
    return int(hop)


def parse_link_message(payload: bytes) -> list[tuple[int, int, bytes]]:
    """(lane, kind, data) of each part of a message; FrameFormatError if it does not parse."""
    parts: list[tuple[int, int, bytes]] = []
    at, end = 0, len(payload)
    while at < end:
        if end - at < LINK_PART.size:
            raise FrameFormatError("a Seam Link message ends inside a part's head")
        lane, kind, n = LINK_PART.unpack_from(payload, at)
        at += LINK_PART.size
        if kind not in (LANE_OPEN, LANE_STEP, LANE_END, LANE_RETURN) or n > end - at:
            raise FrameFormatError(f"a Seam Link part of kind {kind} and {n} bytes does not fit its message")
        parts.append((lane, kind, payload[at:at + n]))
        at += n
    return parts


class ReturnRequest(BaseModel):
    """Which session's tokens a LANE_RETURN asks its tail for."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1, max_length=128)
    route_id: str = Field(min_length=1, max_length=128)
    epoch: int = Field(ge=0)


def parse_lane_open(data: bytes) -> tuple[str, str, bytes]:
    """(header, credential, first step's payload) of a LANE_OPEN (or LANE_RETURN) part."""
    if len(data) < LANE_OPEN_PREFIX.size:
        raise FrameFormatError("a lane's opening part is too short")
    nh, nc = LANE_OPEN_PREFIX.unpack_from(data)
    start = LANE_OPEN_PREFIX.size
    if start + nh + nc > len(data):
        raise FrameFormatError("a lane's opening part is shorter than its header and credential")
    try:
        header = data[start:start + nh].decode()
        credential = data[start + nh:start + nh + nc].decode()
    except UnicodeDecodeError as exc:
        raise FrameFormatError(f"a lane's header is not UTF-8: {exc}") from exc
    return header, credential, data[start + nh + nc:]


def link_answer(lane: int, event: bytes, last: bool) -> bytes:
    """One chunk of a Seam Link's answer: a lane's event."""
    return LINK_ANSWER.pack(lane, last) + event


def parse_link_answer(raw: bytes) -> tuple[int, bool, bytes]:
    """(lane, last, event JSON) of one chunk of a Seam Link's answer."""
    if len(raw) < LINK_ANSWER.size:
        raise FrameFormatError("a Seam Link answer is shorter than its head")
    lane, last = LINK_ANSWER.unpack_from(raw)
    return lane, bool(last), raw[LINK_ANSWER.size:]


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


_HEADER_DEFAULTS = {name: f.default for name, f in FrameHeader.model_fields.items()}
