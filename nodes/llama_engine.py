"""ShardEngine on llama.cpp: one model shard, one llama_context, one KV sequence per session.

How a shard runs (docs/shard-runtime.md has the measurements):
- the shard is its own GGUF (artifacts.shard_file); a non-tail shard has a tiny vocabulary,
  so the LM head llama.cpp always builds costs nothing;
- non-head shards (and a head that is not also the tail) take embeddings through
  `batch.embd`; the head's embedding lookup is done in numpy from the full GGUF;
- a non-tail shard's file ends with a "capture layer"; llama.cpp hands out that layer's
  input rows (= the shard's output) for every token (llama_set_embeddings_layer_inp), so
  no row is an output (the capture layer's FFN and the LM head run on zero rows) and no
  per-node Python callback runs. capture="cb_eval"
  instead copies `l_out-<last layer>` through a graph eval callback (nodes.llama_ffi);
- the tail asks logits for the last row only and samples (nodes.sampling);
- sessions are sequences of one context with `n_seq_max` slots in one unified KV buffer
  of `n_ctx` cells per slot (a session attends only over its own cells); the number of
  slots comes from the KV memory budget (`kv_memory`); closing a session removes its
  sequence from the KV memory, but for leading rows another session may reuse (a retained
  prefix, nodes/shared_prefix.py);
- `forward_batch` runs the rows of many sessions as one llama.cpp batch, one sequence id
  per session (a unified KV buffer keeps them in one micro-batch, whatever slots they hold).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from artifacts.architectures import ArchSupport, arch_support
from artifacts.shard_file import (
    ModelInfo,
    TokenEmbedding,
    materialize_shard,
    read_model_info,
    shard_weights,
)
from artifacts.source import ModelSource, open_source
from artifacts.vocab_file import materialize_vocabulary
from nodes.engine import (
    BatchPart,
    CacheFullError,
    EngineError,
    PartResult,
    ShardOutput,
    TokenChoice,
    UnsupportedModelError,
    single_result,
)
from nodes.llama_ffi import (
    FloatView,
    HiddenCapture,
    LayerInputCapture,
    import_llama_cpp,
    layer_input_api,
    logits_ith_address,
)
from nodes.sampling import token_rng
from nodes.shard_checks import (
    DEFAULT_KV_MEMORY,
    SlotState,
    SlotTable,
    check_forward,
    check_layer_range,
    sessions_for_memory,
)
from nodes.shared_prefix import DEFAULT_PREFIX_ROWS, MIN_REUSE, SharedPrefixIndex
from nodes.speculation import Verifier
from nodes.token_constraint import TokenConstraint
from schemas.capability import (
    DEFAULT_CTX,
    KV_PROFILES,
    Q8_0_BLOCK,
    CapabilityReport,
    KvProfile,
    ShardRange,
    exact_fits,
)
from schemas.output_constraint import OutputConstraint
from schemas.sampling import SamplingParams

_F16_BYTES = 2.0  # a V entry, and a K entry in the default profile
_Q8_0_BYTES = 34 / 32  # a K entry in the exact profile: blocks of 32 int8 values and one f16 scale
_GGML_TYPE_Q8_0 = 8


def _check_profile(kv_profile: str, info: ModelInfo, start: int, end: int) -> None:
    """Refuse an unknown KV profile, and the exact one where a q8_0 K cannot hold a head."""
    if kv_profile not in KV_PROFILES:
        raise ValueError(f"kv_profile must be one of {KV_PROFILES}, not {kv_profile!r}")
    if kv_profile == "exact" and not exact_fits(info.head_dim):
        raise UnsupportedModelError(f"the exact KV profile stores K as q8_0 (blocks of {Q8_0_BLOCK}); this "
                                    f"model's head dimension is {info.head_dim} (--kv-profile default)",
                                    arch=info.arch, start=start, end=end)


def kv_bytes_per_token(n_layers: int, kv_width: int, profile: KvProfile) -> int:
    """K and V cache bytes one token takes in `n_layers` layers under a KV profile (pure)."""
    k = _Q8_0_BYTES if profile == "exact" else _F16_BYTES
    return math.ceil(n_layers * kv_width * (k + _F16_BYTES))

_quiet_logger = None


def prepare_llama_runtime():
    """Import llama_cpp once (nodes.llama_ffi.import_llama_cpp: short OpenMP idle spinning),
    with llama.cpp's logging silenced."""
    global _quiet_logger
    llama_cpp = import_llama_cpp()
    if _quiet_logger is None:
        _quiet_logger = llama_cpp.llama_log_callback(lambda level, text, ud: None)
        llama_cpp.llama_log_set(_quiet_logger, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
    return llama_cpp


def batch_calls(runs: list[tuple[int, int]], n_batch: int,
                stepwise: Sequence[bool] = ()) -> list[list[tuple[int, int, int]]]:
    """How one batch's parts become llama_decode calls (pure): `runs` are (rows, slot) per part;
    each call is a list of (part index, first row, rows). A part flagged in `stepwise` runs
    one row per call, in order: llama.cpp's arithmetic for a row in a one-row-per-sequence
    call differs from the same row inside a longer chunk (docs/shard-runtime.md, "One-row
    calls"), so a replay of decoded tokens must take their steps again to rebuild their KV
    bit for bit.
    Row w of every stepwise part goes into the w-th of those calls (a wave), beside the
    decode rows in the first, as one-row parts of different sequences, whose arithmetic does
    not depend on their neighbours: sessions restarting together replay in parallel.

    With a KV stream per sequence, llama.cpp runs a call as micro-batches of consecutive
    sequence ids with equal token counts. So every one-row part (a decode step) goes into
    one call, in slot order (consecutive slots share one micro-batch), and each longer part
    (a prefill chunk) into calls of its own of at most n_batch rows; every call's rows are
    then in the order llama.cpp runs them, which is the order the captured rows come back in."""
    steps = {r for r, (n, _) in enumerate(runs) if n > 1 and r < len(stepwise) and stepwise[r]}
    singles = sorted((r for r, (n, _) in enumerate(runs) if n == 1), key=lambda r: runs[r][1])
    waves = max((runs[r][0] for r in steps), default=0)
    calls: list[list[tuple[int, int, int]]] = []
    for w in range(waves):
        rows = [(r, w) for r in steps if runs[r][0] > w] + ([(r, 0) for r in singles] if w == 0 else [])
        rows.sort(key=lambda e: runs[e[0]][1])
        calls.extend([[(r, lo, 1) for r, lo in rows[a:a + n_batch]] for a in range(0, len(rows), n_batch)])
    if not waves:
        calls = [[(r, 0, 1) for r in singles[lo:lo + n_batch]] for lo in range(0, len(singles), n_batch)]
    for r, (n, _) in enumerate(runs):
        if n > 1 and r not in steps:
            cuts = [*range(0, n, n_batch), n]
            if len(cuts) > 2 and cuts[-1] - cuts[-2] == 1:
                cuts[-2] -= 1  # the last (sampled) row never in a call of its own
            calls.extend([[(r, a, b - a)] for a, b in itertools.pairwise(cuts)])
    return calls


MAX_RETAINED = 2  # closed sessions' prefixes a shard keeps for reuse (close_session)
MEASURE_ROUNDS = 4  # at most, of the self-measurement at load (_self_measure)
MEASURE_SETTLED = 1.15  # a round whose fastest decode step beats the rounds before by less ends it


class LlamaShardEngine:
    """Layers [start, end) of a GGUF model served by llama.cpp for as many sessions as the KV
    budget `kv_memory` holds at `n_ctx` tokens each (or `max_sessions`, if smaller)."""

    runtime = "llama.cpp"

    def __init__(
        self,
        model_path: str | Path | ModelSource,
        start: int,
        end: int,
        *,
        n_ctx: int = DEFAULT_CTX,
        kv_memory: int = DEFAULT_KV_MEMORY,
        max_sessions: int | None = None,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_batch: int = 512,
        flash_attn: bool = False,
        kv_profile: KvProfile = "default",
        capture: str = "auto",
        measure: bool = True,
        prefix_rows: int = DEFAULT_PREFIX_ROWS,
    ) -> None:
        self._closed = True
        model_path = open_source(model_path)  # a GGUF file or a piece store (artifacts/source.py)
        info = read_model_info(model_path)
        _check_profile(kv_profile, info, start, end)
        self._layers = check_layer_range(start, end, info.n_layer)
        partial = not (self._layers.is_head and self._layers.is_tail)
        if partial and not info.splittable:
            raise UnsupportedModelError(info.reason, arch=info.arch, start=start, end=end)
        self._info = info
        self._revision = model_path.revision
        self._source = model_path
        self._weights = shard_weights(model_path.header, start, end)  # Capability Report (header only)
        self.active_param_bytes = self._weights.active_bytes  # per token, for the ledger
        self._shard_path = materialize_shard(model_path, start, end)
        self._shard_bytes = self._shard_path.stat().st_size  # the cache file may be evicted later
        self._n_batch = n_batch
        self._kv_profile: KvProfile = kv_profile
        self._flash_attn = flash_attn or kv_profile == "exact"
        self._n_threads = n_threads or os.cpu_count() or 1
        self._n_threads_batch = n_threads_batch or self._n_threads
        self._embedding = TokenEmbedding(model_path) if self._layers.is_head and partial else None
        self._embd_input = not self._layers.is_head or partial
        support = arch_support(info.arch)
        self._embed_scale = (np.float32(math.sqrt(info.n_embd))
                             if support is not None and support.scales_token_embeddings else None)
        self._capture: HiddenCapture | LayerInputCapture | None = None
        self._set_capture(capture, support, n_batch)
        slots = self._slot_count(kv_memory, n_ctx, max_sessions, kv_profile)
        self._sessions = SlotTable(slots, constraint=self._constraint if self._layers.is_tail else None)
        # leading rows one session computed that another may reuse (nodes/shared_prefix.py)
        self._prefix = SharedPrefixIndex(prefix_rows, None if self._layers.is_tail else info.n_embd)
        self._retained: dict[str, int] = {}  # a closed session's prefix kept in its free slot, oldest first
        # tokens/s of this shard's fastest prefill and decode call at load (self-measurement);
        # the live figures are the node's (EngineRunner's WorkMeter, in heartbeats)
        self._measured_tps = (0.0, 0.0)
        self._logits_view = FloatView()
        self._logits_ith = logits_ith_address()
        self._load(n_ctx, slots)
        if measure:
            self._self_measure()

    # -- loading ---------------------------------------------------------------------------

    def _set_capture(self, capture: str, support: ArchSupport | None, n_batch: int) -> None:
        """How a non-tail shard hands out its output rows (`capture`: auto, layer_inp, cb_eval)."""
        if capture == "auto" and support is not None and not support.layer_input_capture:
            capture = "cb_eval"  # its graph builder records no layer input (artifacts/architectures.py)
        self._capture_mode = "" if self._layers.is_tail else self._pick_capture(capture)
        if self._capture_mode == "cb_eval":
            self._capture = HiddenCapture(f"l_out-{self._layers.n_layers - 1}", self._info.n_embd, n_batch)

    def _slot_count(self, kv_memory: int, n_ctx: int, max_sessions: int | None, kv_profile: KvProfile) -> int:
        """Session slots the KV budget holds (a non-tail file carries one more, capture, layer)."""
        n_file_layers = self._layers.n_layers + (0 if self._layers.is_tail else 1)
        self._kv_per_token = kv_bytes_per_token(n_file_layers, self._info.kv_width, kv_profile)
        slots = sessions_for_memory(kv_memory, self._kv_per_token, n_ctx)
        return slots if max_sessions is None else max(1, min(slots, max_sessions))

    @staticmethod
    def _pick_capture(capture: str) -> str:
        prepare_llama_runtime()
        if capture == "auto":
            return "layer_inp" if layer_input_api() is not None else "cb_eval"
        if capture not in ("layer_inp", "cb_eval"):
            raise ValueError(f"capture must be auto, layer_inp or cb_eval, not {capture!r}")
        return capture

    def _load(self, n_ctx: int, max_sessions: int) -> None:
        ll = prepare_llama_runtime()
        self._ll = ll
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self._model = ll.llama_model_load_from_file(str(self._shard_path).encode(), mparams)
        if not self._model:
            raise EngineError(f"llama.cpp could not load {self._shard_path}", path=str(self._shard_path))
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx * max_sessions
        cparams.n_batch = cparams.n_ubatch = self._n_batch
        cparams.n_seq_max = max_sessions
        cparams.kv_unified = False
        cparams.n_threads = self._n_threads
        cparams.n_threads_batch = self._n_threads_batch
        cparams.no_perf = True
        cparams.embeddings = False
        cparams.flash_attn_type = (
            ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if self._flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        if self._kv_profile == "exact":
            # a q8_0 K keeps every query row on flash attention's one scalar kernel, whatever
            # the call's other rows (docs/benchmarks.md, "Can a batched replay be exact?")
            cparams.type_k = _GGML_TYPE_Q8_0
        if self._capture is not None:
            cparams.cb_eval = ctypes.cast(self._capture.callback, ll.ggml_backend_sched_eval_callback)
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            ll.llama_model_free(self._model)
            raise EngineError("llama.cpp could not create a context", n_ctx=n_ctx, max_sessions=max_sessions)
        self._closed = False
        self._mem = ll.llama_get_memory(self._ctx)
        self._n_ctx = n_ctx  # per session: the unified buffer holds n_ctx cells for every slot
        self._n_vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self._model)))
        self._n_vocab_in = self._info.n_vocab  # ids the head accepts (the full vocabulary)
        if self._capture_mode == "layer_inp":
            self._capture = LayerInputCapture(self._ctx, self._layers.n_layers, self._info.n_embd, self._n_batch)
        self._make_batch()

    def _make_batch(self) -> None:
        ll, n = self._ll, self._n_batch
        self._batch = ll.llama_batch_init(n, self._info.n_embd if self._embd_input else 0, 1)
        b = self._batch
        as_np = np.ctypeslib.as_array
        if self._embd_input:
            self._b_embd = as_np(b.embd, shape=(n * self._info.n_embd,)).reshape(n, self._info.n_embd)
        else:
            self._b_token = as_np(b.token, shape=(n,))
        self._b_pos = as_np(b.pos, shape=(n,))
        as_np(b.n_seq_id, shape=(n,))[:] = 1
        self._b_logits = as_np(b.logits, shape=(n,))
        self._b_logits[:] = 0
        self._mv_pos = memoryview(self._b_pos).cast("B").cast("i")  # native formats: item writes without numpy
        self._mv_logits = memoryview(self._b_logits).cast("B").cast("b")
        self._b_seq = [as_np(b.seq_id[i], shape=(1,)) for i in range(n)]
        self._b_seq_of = [-1] * n  # the sequence id each row holds, as last written
        self._b_flagged: list[int] = []  # rows whose logits flag is set
        self._verifying: dict[int, Verifier] = {}  # the call's verify steps on a tail, by run index

    def _self_measure(self) -> None:
        """A quick prefill + decode on a scratch session, so the report has real tok/s at once.

        Rounds of one prefill chunk and three decode steps; the report takes the fastest call
        of each kind, since a neighbour's work only ever slows a call down, and rounds go on
        (up to MEASURE_ROUNDS) while a round still finds a faster decode step: four nodes
        starting together on 2 cores measured 13 to 136 tok/s for the same shard with one
        round, and the tracker, taking the slow ones for stragglers, put every session on one
        replica (docs/benchmarks.md, "Balanced replicas")."""
        sid = "__measure__"
        self.open_session(sid)
        try:
            n = max(2, min(64, self._n_batch, self._n_ctx // MEASURE_ROUNDS - 3))
            rng = np.random.default_rng(0)
            best = {False: 0.0, True: 0.0}  # by "is a decode step"
            pos = 0
            for _ in range(MEASURE_ROUNDS):
                if pos + n + 3 > self._n_ctx:
                    break
                before = best[True]
                for rows in (n, 1, 1, 1):
                    t0 = time.perf_counter()
                    if self._layers.is_head:
                        self.forward(sid, pos, token_ids=rng.integers(0, self._n_vocab_in, rows, dtype=np.int32))
                    else:
                        hidden = rng.standard_normal((rows, self._info.n_embd), dtype=np.float32)
                        self.forward(sid, pos, hidden=hidden)
                    best[rows == 1] = max(best[rows == 1], rows / max(1e-9, time.perf_counter() - t0))
                    pos += rows
                if before and best[True] <= MEASURE_SETTLED * before:
                    break
            self._measured_tps = (best[False], best[True])
        finally:
            self._close(sid, retain=False)  # random rows: nothing to reuse

    # -- ShardEngine -----------------------------------------------------------------------

    @property
    def layers(self) -> ShardRange:
        return self._layers

    @property
    def hidden_size(self) -> int:
        return self._info.n_embd

    @property
    def n_vocab(self) -> int:
        """Vocabulary size of the model (token ids a head accepts, logits a tail returns)."""
        return self._n_vocab_in

    @property
    def shard_path(self) -> Path:
        """The GGUF file llama.cpp runs for this shard."""
        return self._shard_path

    def capability(self) -> CapabilityReport:
        """What this shard can do and how fast it measured itself."""
        return CapabilityReport(
            model_arch=self._info.arch,
            model_name=self._info.name,
            model_revision=self._revision,
            runtime="llama.cpp",
            layers=self._layers,
            hidden_size=self._info.n_embd,
            vocab_size=self._n_vocab_in,
            n_ctx=self._n_ctx,
            supports_layer_range=self._info.splittable,
            supports_partial_artifacts=True,  # runs from a piece store (artifacts/piece_store.py)
            cache_abi=f"llama.cpp/kv-f16/{self._info.arch}",
            cache_bytes_per_token=self._kv_per_token,
            kv_profile=self._kv_profile,
            prefill_tokens_per_second=round(self._measured_tps[0], 1),
            decode_tokens_per_second=round(self._measured_tps[1], 1),
            memory_floor_bytes=self._shard_bytes + self._embedding_bytes(),
            max_sessions=self._sessions.max_sessions,
            param_bytes=self._weights.param_bytes,
            active_param_bytes_per_token=self._weights.active_bytes,
            expert_count=self._info.expert_count,
            expert_used_count=self._info.expert_used_count,
        )

    def _embedding_bytes(self) -> int:
        return 0 if self._embedding is None else self._embedding.nbytes

    def open_session(self, session_id: str, sampling: SamplingParams | None = None) -> None:
        """Allocate an empty Hot KV State (a free sequence slot) for a session."""
        self._check_open()
        state = self._sessions.open(session_id, sampling)
        self._forget_retained(state.slot)
        self._ll.llama_memory_seq_rm(self._mem, state.slot, -1, -1)

    def adopt_session(self, old_id: str, new_id: str, keep: int, sampling: SamplingParams | None = None) -> None:
        """Continue `old_id` as `new_id` on the same sequence slot, its KV cut to `keep` positions."""
        self._check_open()
        state = self._sessions.rename(old_id, new_id, keep, sampling)
        self._prefix.rename(old_id, new_id)
        self._prefix.cut(new_id, keep)
        if not self._ll.llama_memory_seq_rm(self._mem, state.slot, keep, -1):  # a memory that cannot cut
            self.close_session(new_id)
            raise EngineError(f"llama.cpp could not cut session {old_id} back to {keep} positions")

    def forward(
        self,
        session_id: str,
        position: int,
        *,
        token_ids: np.ndarray | None = None,
        hidden: np.ndarray | None = None,
        want_logits: bool = False,
    ) -> ShardOutput:
        """Run a prefill chunk or a decode step for one session at `position`."""
        rows = token_ids if self._layers.is_head else hidden
        if rows is None or (token_ids is not None and hidden is not None):
            rows = hidden if token_ids is None else token_ids  # check_forward names the mistake
        return single_result(self.forward_batch([BatchPart(session_id, position, rows, want_logits=want_logits)]))

    def forward_batch(self, parts: list[BatchPart]) -> list[PartResult]:
        """Run every part's rows as one llama.cpp batch (or consecutive batches of at most
        n_batch rows), one sequence id per session; a part that fails its checks fails alone."""
        self._check_open()
        results: list[PartResult | None] = [None] * len(parts)
        runs: list[tuple[int, SlotState, np.ndarray]] = []
        seen: set[str] = set()
        for i, part in enumerate(parts):
            try:
                runs.append((i, self._check_part(part, seen), part.rows))
            except EngineError as exc:
                results[i] = exc
        if runs:
            self._run(parts, runs, results)
        return results  # type: ignore[return-value]

    def _check_part(self, part: BatchPart, seen: set[str]) -> SlotState:
        state = self._sessions.get(part.session_id)
        if part.session_id in seen:
            raise EngineError(f"session {part.session_id!r} has two parts in one batch", session_id=part.session_id)
        if part.rewind and part.position < state.position:
            self._rewind(state, part.position)
        head = self._layers.is_head
        part.rows = check_forward(
            state, part.position, self._layers, hidden_size=self._info.n_embd, n_vocab=self._n_vocab_in,
            n_ctx=self._n_ctx, token_ids=part.rows if head else None, hidden=None if head else part.rows,
        )
        seen.add(part.session_id)
        return state

    def _run(self, parts: list[BatchPart], runs: list[tuple[int, SlotState, np.ndarray]],
             results: list[PartResult | None]) -> int:
        """Run the checked parts in calls of at most n_batch rows; fill in their results.
        Returns the rows computed (a shared prefix's reused rows are not).

        Decode steps and stepwise rows run first (batch_calls), then each longer part in calls
        of its own, one part after another. A part that opens a session looks for a shared
        prefix (nodes/shared_prefix.py) just before its calls, so it can also reuse what a part
        before it in this batch made (sessions that start together)."""
        if self._embedding is not None:
            runs = [(i, st, self._embed(rows)) for i, st, rows in runs]
        starts = [parts[i].position for i, _, _ in runs]
        pieces: list[list[np.ndarray]] = [[] for _ in runs]
        reused: dict[int, tuple[int, np.ndarray | None]] = {}
        hidden: dict[int, np.ndarray] = {}
        self._verifying = {r: self._verifier(parts[i], st) for r, (i, st, _) in enumerate(runs)
                           if self._capture is None and parts[i].drafts is not None and parts[i].sample}
        short = [r for r, (i, _, rows) in enumerate(runs) if len(rows) == 1 or parts[i].stepwise]
        long = sorted(set(range(len(runs))) - set(short))
        try:
            for call in batch_calls([(len(runs[r][2]), runs[r][1].slot) for r in short], self._n_batch,
                                    [parts[runs[r][0]].stepwise for r in short]):
                self._decode_call(parts, runs, starts, [(short[k], lo, n) for k, lo, n in call], pieces, results)
            for r in long:
                i, state, rows = runs[r]
                found = self._reuse_prefix(parts[i], state)
                if found is not None:
                    reused[r] = found
                    runs[r] = (i, state, rows[found[0]:])
                    starts[r] += found[0]
                for call in batch_calls([(len(runs[r][2]), state.slot)], self._n_batch):
                    self._decode_call(parts, runs, starts, [(r, lo, n) for _, lo, n in call], pieces, results)
                if self._capture is not None:
                    kept = reused.get(r, (0, None))[1]
                    got = pieces[r] if kept is None else [kept, *pieces[r]]
                    hidden[r] = got[0] if len(got) == 1 else np.concatenate(got)
                self._prefix.extend(state.session_id, parts[i].position, parts[i].rows, hidden.get(r))
        except EngineError as exc:
            for i, state, _ in runs:  # a failed call leaves no partial state
                self._ll.llama_memory_seq_rm(self._mem, state.slot, parts[i].position, -1)
                self._prefix.cut(state.session_id, parts[i].position)
                results[i] = exc
            return sum(len(rows) for _, _, rows in runs)
        for r, (i, state, _) in enumerate(runs):
            state.position = parts[i].position + len(parts[i].rows)
            if self._capture is not None:
                got = pieces[r]
                results[i] = ShardOutput(hidden=hidden[r] if r in hidden else got[0] if len(got) == 1
                                         else np.concatenate(got))
            elif r in self._verifying:
                v = self._verifying[r]
                results[i] = ShardOutput(token=v.token, accepted=v.accepted)
            elif results[i] is None:
                results[i] = ShardOutput()  # a tail part that only filled the cache
            result = results[i]
            if r in reused and isinstance(result, ShardOutput):
                result.reused = reused[r][0]
        return sum(len(rows) for _, _, rows in runs)

    def _rewind(self, state: SlotState, position: int) -> None:
        """Drop a session's rows from `position` on (drafts a verify step did not keep)."""
        if not self._ll.llama_memory_seq_rm(self._mem, state.slot, position, -1):
            raise EngineError(f"llama.cpp could not cut session {state.session_id} back to {position} positions")
        self._prefix.cut(state.session_id, position)
        state.position = position

    def _verifier(self, part: BatchPart, state: SlotState) -> Verifier:
        """The tail's check of a verify step's rows (nodes/speculation.py), with the session's
        own token choice at each position."""
        def choose(logits: np.ndarray, position: int) -> TokenChoice:
            return state.sampler.choose(logits, token_rng(state.sampling, position, state.rng))

        assert part.drafts is not None
        return Verifier(part.drafts, choose, part.position + 1)

    def _reuse_prefix(self, part: BatchPart, state: SlotState) -> tuple[int, np.ndarray | None] | None:
        """If `part` opens an empty session with rows another session holds (nodes/shared_prefix.py),
        copy that session's KV into this one's sequence, cut to the shared rows: (rows reused,
        their outputs off the tail). The copy itself runs at the next llama_decode."""
        if not self._prefix.enabled or part.stepwise or part.position != 0 or state.position != 0:
            return None
        found = self._prefix.match(part.rows)
        if found is None or found.holder == state.session_id:
            return None
        outputs = self._prefix.outputs(found.holder, found.rows) if self._capture is not None else None
        if self._capture is not None and outputs is None:
            return None
        src = self._retained.get(found.holder)
        if src is None:
            src = self._sessions.get(found.holder).slot
        self._ll.llama_memory_seq_cp(self._mem, src, state.slot, -1, -1)  # a whole stream, then cut
        if not self._ll.llama_memory_seq_rm(self._mem, state.slot, found.rows, -1):
            self._ll.llama_memory_seq_rm(self._mem, state.slot, -1, -1)
            return None
        self._prefix.reused(state.session_id, found)
        return found.rows, outputs

    def _decode_call(self, parts: list[BatchPart], runs: list[tuple[int, SlotState, np.ndarray]],
                     starts: list[int], call: list[tuple[int, int, int]], pieces: list[list[np.ndarray]],
                     results: list[PartResult | None]) -> None:
        """Fill the batch with `call`'s rows, run llama_decode, hand out rows and tokens.

        Each write costs ~15-30 µs right after a model call (cold caches), so a one-row piece
        uses item writes and only changed sequence ids and logits flags are written."""
        tail = self._capture is None
        mv_logits = self._mv_logits
        for row in self._b_flagged:
            mv_logits[row] = 0
        flagged: list[tuple[int, int, int]] = []  # (batch row, run index, row in the part) whose token is chosen
        off = 0
        for r, lo, n in call:
            i, state, rows = runs[r]
            pos = starts[r] + lo
            chunk = rows[lo:lo + n]
            if self._embd_input:
                self._b_embd[off:off + n] = chunk
            else:
                self._b_token[off:off + n] = chunk
            if n == 1:
                self._mv_pos[off] = pos
            else:
                self._b_pos[off:off + n] = np.arange(pos, pos + n, dtype=np.int32)
            seq_of = self._b_seq_of
            for row in range(off, off + n):
                if seq_of[row] != state.slot:
                    self._b_seq[row][0] = seq_of[row] = state.slot
            if r in self._verifying:  # a verify step: every row chooses a token
                for j in range(n):
                    mv_logits[off + j] = 1
                    flagged.append((off + j, r, lo + j))
            elif tail and parts[i].sample and lo + n == len(rows):
                mv_logits[off + n - 1] = 1
                flagged.append((off + n - 1, r, lo + n - 1))
            off += n
        self._b_flagged = [row for row, _, _ in flagged]
        if self._capture is not None:
            self._capture.reset()
        self._batch.n_tokens = off
        rc = self._ll.llama_decode(self._ctx, self._batch)
        if rc == 1:
            raise CacheFullError("llama.cpp found no KV slot for the batch", n_tokens=off)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc}", rc=rc, n_tokens=off)
        if self._capture is not None:
            if self._capture_mode == "cb_eval" and self._capture.rows != off:
                raise EngineError(f"captured {self._capture.rows} hidden rows, expected {off}")
            out = self._capture.collect(off)
            off = 0
            for r, _, n in call:
                pieces[r].append(out[off:off + n] if len(call) > 1 else out)
                off += n
            return
        self._choose(parts, runs, starts, flagged, results)

    def _choose(self, parts: list[BatchPart], runs: list[tuple[int, SlotState, np.ndarray]], starts: list[int],
                flagged: list[tuple[int, int, int]], results: list[PartResult | None]) -> None:
        """The tail's tokens from the call's flagged rows: a part's token from its last row, or
        a verify step's rows one by one to its Verifier."""
        view = self._logits_view
        for row, r, j in flagged:
            i, state, rows = runs[r]
            part = parts[i]
            view(self._logits_ith(self._ctx, row), 1, self._n_vocab)
            logits = view.flat
            if r in self._verifying:
                self._verifying[r].row(j, logits)
                continue
            rng = token_rng(state.sampling, starts[r] + len(rows), state.rng)
            results[i] = ShardOutput(token=state.sampler.choose(logits, rng),
                                     logits=logits.copy() if part.want_logits else None)

    def _constraint(self, constraint: OutputConstraint) -> TokenConstraint:
        """A session's output constraint, over this tail's vocabulary."""
        return TokenConstraint(constraint, materialize_vocabulary(self._source))

    def shared_prefix_stats(self) -> dict[str, int]:
        """Sessions that began from another session's KV, and the rows they did not compute."""
        return {"hits": self._prefix.hits, "rows_reused": self._prefix.rows_reused}

    def position(self, session_id: str) -> int:
        """The session's next position (tokens already in its Hot KV State)."""
        return self._sessions.get(session_id).position

    def cache_bytes(self, session_id: str) -> int:
        """Bytes of KV cache the session holds on this shard."""
        return self._sessions.get(session_id).position * self._kv_per_token

    def close_session(self, session_id: str) -> None:
        """Free the session's slot. Its indexed leading rows (nodes/shared_prefix.py) stay in the
        slot's cache for a later session to reuse, until the slot is needed again (the slot is
        handed out last) or MAX_RETAINED newer prefixes are retained; the rest is dropped."""
        self._close(session_id, retain=True)

    def _close(self, session_id: str, *, retain: bool) -> None:
        held = self._prefix.held_rows(session_id) if retain else 0
        retain = held >= MIN_REUSE and not self._closed
        state = self._sessions.close(session_id, last=retain)
        if self._closed:
            return
        if not retain:
            self._prefix.drop(session_id)
            self._ll.llama_memory_seq_rm(self._mem, state.slot, -1, -1)
            return
        key = f"retained:{state.slot}"
        self._prefix.rename(session_id, key)
        self._ll.llama_memory_seq_rm(self._mem, state.slot, held, -1)
        self._retained[key] = state.slot
        while len(self._retained) > MAX_RETAINED:
            self._forget_retained(next(iter(self._retained.values())), clear=True)

    def _forget_retained(self, slot: int, *, clear: bool = False) -> None:
        """The slot's retained prefix is no longer reused (the slot is taken, or a newer one
        replaces it)."""
        key = f"retained:{slot}"
        if self._retained.pop(key, None) is None:
            return
        self._prefix.drop(key)
        if clear:
            self._ll.llama_memory_seq_rm(self._mem, slot, -1, -1)

    def sessions(self) -> list[str]:
        """Open session ids."""
        return self._sessions.ids()

    def close(self) -> None:
        """Free the context, the model and every session."""
        if self._closed:
            return
        self._closed = True
        for sid in self._sessions.ids():
            self._sessions.close(sid)
            self._prefix.drop(sid)
        self._ll.llama_batch_free(self._batch)
        self._ll.llama_free(self._ctx)
        self._ll.llama_model_free(self._model)

    def _embed(self, token_ids: np.ndarray) -> np.ndarray:
        """The head's input rows: its tokens' embeddings, scaled as the graph would scale
        tokens (artifacts/architectures.py) since llama.cpp takes them as embeddings."""
        assert self._embedding is not None
        rows = self._embedding.lookup(token_ids)
        return rows if self._embed_scale is None else rows * self._embed_scale

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")

    def __enter__(self) -> LlamaShardEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
