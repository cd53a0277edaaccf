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
- sessions are sequences of one context with `n_seq_max` slots and a per-sequence KV
  stream (kv_unified off: a session attends only over its own cells); closing a session
  removes its sequence from the KV memory.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np

from artifacts.revision import model_revision
from artifacts.shard_file import TokenEmbedding, materialize_shard, read_model_info
from nodes.engine import CacheFullError, EngineError, ShardOutput, UnsupportedModelError
from nodes.llama_ffi import (
    FloatView,
    HiddenCapture,
    LayerInputCapture,
    import_llama_cpp,
    layer_input_api,
    logits_ith_address,
)
from nodes.sampling import choose_token
from nodes.shard_checks import RateMeter, SessionTable, check_forward, check_layer_range
from schemas.capability import CapabilityReport, ShardRange
from schemas.sampling import SamplingParams

_KV_BYTES = 2  # f16 K and V cache entries
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


class LlamaShardEngine:
    """Layers [start, end) of a GGUF model served by llama.cpp for up to `max_sessions` sessions."""

    runtime = "llama.cpp"

    def __init__(
        self,
        model_path: str | Path,
        start: int,
        end: int,
        *,
        n_ctx: int = 2048,
        max_sessions: int = 4,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_batch: int = 512,
        flash_attn: bool = False,
        capture: str = "auto",
        measure: bool = True,
    ) -> None:
        self._closed = True
        info = read_model_info(model_path)
        self._layers = check_layer_range(start, end, info.n_layer)
        partial = not (self._layers.is_head and self._layers.is_tail)
        if partial and not info.splittable:
            raise UnsupportedModelError(info.reason, arch=info.arch, start=start, end=end)
        self._info = info
        self._revision = model_revision(model_path)
        self._shard_path = materialize_shard(model_path, start, end)
        self._n_batch = n_batch
        self._flash_attn = flash_attn
        self._n_threads = n_threads or os.cpu_count() or 1
        self._n_threads_batch = n_threads_batch or self._n_threads
        self._embedding = TokenEmbedding(model_path) if self._layers.is_head and partial else None
        self._embd_input = not self._layers.is_head or partial
        self._capture_mode = "" if self._layers.is_tail else self._pick_capture(capture)
        self._capture: HiddenCapture | LayerInputCapture | None = None
        if self._capture_mode == "cb_eval":
            self._capture = HiddenCapture(f"l_out-{self._layers.n_layers - 1}", info.n_embd, n_batch)
        self._sessions = SessionTable(max_sessions)
        self._rates = RateMeter()
        self._logits_view = FloatView()
        self._logits_ith = logits_ith_address()
        self._load(n_ctx, max_sessions)
        if measure:
            self._self_measure()

    # -- loading ---------------------------------------------------------------------------

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
        if self._capture is not None:
            cparams.cb_eval = ctypes.cast(self._capture.callback, ll.ggml_backend_sched_eval_callback)
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            ll.llama_model_free(self._model)
            raise EngineError("llama.cpp could not create a context", n_ctx=n_ctx, max_sessions=max_sessions)
        self._closed = False
        self._mem = ll.llama_get_memory(self._ctx)
        self._n_ctx = int(ll.llama_n_ctx_seq(self._ctx))
        self._n_vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self._model)))
        self._n_vocab_in = self._info.n_vocab  # ids the head accepts (the full vocabulary)
        n_file_layers = self._layers.n_layers + (0 if self._layers.is_tail else 1)  # + capture layer
        self._kv_per_token = n_file_layers * 2 * self._info.kv_width * _KV_BYTES
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
        self._b_want = 1 if self._capture is None else 0  # the last row's logits flag: only a tail samples
        self._b_row0 = 0  # the first row's logits flag as last written
        self._b_n = -1  # batch.n_tokens as last written
        self._b_seq = [as_np(b.seq_id[i], shape=(1,)) for i in range(n)]
        self._b_seq_value, self._b_seq_count = -1, 0

    def _self_measure(self) -> None:
        """A quick prefill + decode on a scratch session, so the report has real tok/s at once."""
        sid = "__measure__"
        self.open_session(sid)
        try:
            n = min(64, self._n_batch, self._n_ctx - 4)
            rng = np.random.default_rng(0)
            for pos, rows in ((0, n), (n, 1), (n + 1, 1), (n + 2, 1)):
                if self._layers.is_head:
                    self.forward(sid, pos, token_ids=rng.integers(0, self._n_vocab_in, rows, dtype=np.int32))
                else:
                    hidden = rng.standard_normal((rows, self._info.n_embd), dtype=np.float32)
                    self.forward(sid, pos, hidden=hidden)
        finally:
            self.close_session(sid)

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
            supports_partial_artifacts=False,
            cache_abi=f"llama.cpp/kv-f16/{self._info.arch}",
            cache_bytes_per_token=self._kv_per_token,
            prefill_tokens_per_second=round(self._rates.prefill, 1),
            decode_tokens_per_second=round(self._rates.decode, 1),
            memory_floor_bytes=self._shard_path.stat().st_size + self._embedding_bytes(),
            max_sessions=self._sessions.max_sessions,
        )

    def _embedding_bytes(self) -> int:
        return 0 if self._embedding is None else self._embedding.nbytes

    def open_session(self, session_id: str, sampling: SamplingParams | None = None) -> None:
        """Allocate an empty Hot KV State (a free sequence slot) for a session."""
        self._check_open()
        state = self._sessions.open(session_id, sampling)
        self._ll.llama_memory_seq_rm(self._mem, state.slot, -1, -1)

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
        self._check_open()
        state = self._sessions.get(session_id)
        rows = check_forward(
            state, position, self._layers, hidden_size=self._info.n_embd, n_vocab=self._n_vocab_in,
            n_ctx=self._n_ctx, token_ids=token_ids, hidden=hidden,
        )
        t0 = time.perf_counter()
        if self._embedding is not None:
            rows = self._embedding.lookup(rows)
        out_rows: list[np.ndarray] = []
        try:
            for lo in range(0, len(rows), self._n_batch):
                chunk = rows[lo : lo + self._n_batch]
                self._decode(state.slot, position + lo, chunk)
                if self._capture is not None:
                    out_rows.append(self._capture.collect(len(chunk)))
        except BaseException:
            # a failed call leaves no partial state: drop whatever this call appended
            self._ll.llama_memory_seq_rm(self._mem, state.slot, position, -1)
            raise
        state.position = position + len(rows)
        result = self._finish(state, out_rows, want_logits)
        self._rates.observe(len(rows), time.perf_counter() - t0)
        return result

    def _finish(self, state, out_rows: list[np.ndarray], want_logits: bool) -> ShardOutput:
        if self._capture is not None:
            return ShardOutput(hidden=out_rows[0] if len(out_rows) == 1 else np.concatenate(out_rows))
        view = self._logits_view
        view(self._logits_ith(self._ctx, -1), 1, self._n_vocab)
        logits = view.flat
        token = choose_token(logits, state.sampling, state.rng)
        return ShardOutput(token=token, logits=logits.copy() if want_logits else None)

    def _decode(self, seq: int, position: int, chunk: np.ndarray) -> None:
        n = len(chunk)
        if self._embd_input:
            self._b_embd[:n] = chunk
        else:
            self._b_token[:n] = chunk
        # a non-tail shard asks for no output row at all: its capture layer's FFN, final norm
        # and LM head then run on zero rows; the rows it needs come from the capture. A decode
        # step writes only what changed since the last call (each numpy or ctypes write costs
        # ~15-30 µs right after a model call: the caches are cold)
        if n == 1:
            self._mv_pos[0] = position
            if self._b_row0 != self._b_want:
                self._mv_logits[0] = self._b_row0 = self._b_want
        else:
            self._b_pos[:n] = np.arange(position, position + n, dtype=np.int32)
            self._b_logits[:n] = 0
            self._b_row0 = 0
            if self._b_want:
                self._b_logits[n - 1] = 1  # the tail samples the last row
        if self._b_seq_value != seq or self._b_seq_count < n:
            for i in range(n):
                self._b_seq[i][0] = seq
            self._b_seq_value, self._b_seq_count = seq, n
        if self._capture is not None:
            self._capture.reset()
        if self._b_n != n:
            self._batch.n_tokens = self._b_n = n
        rc = self._ll.llama_decode(self._ctx, self._batch)
        if rc == 1:
            raise CacheFullError("llama.cpp found no KV slot for the batch", seq=seq, position=position, n_tokens=n)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc}", rc=rc, seq=seq, position=position)
        if self._capture_mode == "cb_eval" and self._capture.rows != n:
            raise EngineError(f"captured {self._capture.rows} hidden rows, expected {n}", seq=seq)

    def position(self, session_id: str) -> int:
        """The session's next position (tokens already in its Hot KV State)."""
        return self._sessions.get(session_id).position

    def cache_bytes(self, session_id: str) -> int:
        """Bytes of KV cache the session holds on this shard."""
        return self._sessions.get(session_id).position * self._kv_per_token

    def close_session(self, session_id: str) -> None:
        """Drop the session's KV sequence and free its slot."""
        state = self._sessions.close(session_id)
        if not self._closed:
            self._ll.llama_memory_seq_rm(self._mem, state.slot, -1, -1)

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
        self._ll.llama_batch_free(self._batch)
        self._ll.llama_free(self._ctx)
        self._ll.llama_model_free(self._model)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")

    def __enter__(self) -> LlamaShardEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
