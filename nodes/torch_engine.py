"""ShardEngine on PyTorch: the reference backend, reading the same GGUF as llama.cpp.

Weights are dequantized with gguf.quants.dequantize to float32; the model math is in
nodes/torch_model.py. Each session owns its KVCache list. torch is imported only here.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from artifacts.gguf_header import read_header
from artifacts.revision import model_revision
from artifacts.shard_file import read_model_info, shard_weights
from artifacts.vocab_file import materialize_vocabulary
from nodes.engine import BatchPart, EngineError, PartResult, ShardOutput, UnsupportedModelError
from nodes.sampling import token_rng
from nodes.shard_checks import (
    DEFAULT_KV_MEMORY,
    SlotState,
    SlotTable,
    check_forward,
    check_layer_range,
    sessions_for_memory,
)
from nodes.token_constraint import TokenConstraint
from schemas.capability import DEFAULT_CTX, CapabilityReport, ShardRange
from schemas.sampling import SamplingParams

_BLK_PREFIX = "blk."
TORCH_ARCHS = frozenset({"llama"})  # what nodes/torch_model.py implements (dense only)


def _wanted(name: str, start: int, end: int, n_layer: int) -> bool:
    """Does the shard [start, end) need GGUF tensor `name`?"""
    if name.startswith(_BLK_PREFIX):
        return start <= int(name.split(".")[1]) < end
    if name == "token_embd.weight":
        return start == 0 or end == n_layer  # embedding; tied LM head on the tail
    return end == n_layer or name == "rope_freqs.weight"


class TorchShardEngine:
    """Layers [start, end) of a llama GGUF in float32 PyTorch, one KVCache list per session."""

    runtime = "torch"

    def __init__(
        self,
        model_path: str | Path,
        start: int,
        end: int,
        *,
        n_ctx: int = DEFAULT_CTX,
        kv_memory: int = DEFAULT_KV_MEMORY,
        max_sessions: int | None = None,
        n_threads: int | None = None,
        **_ignored: object,
    ) -> None:
        import gguf
        import torch

        from nodes.torch_model import ModelArgs, ShardTransformer

        info = read_model_info(model_path)
        self._layers = check_layer_range(start, end, info.n_layer)
        if not info.splittable:
            raise UnsupportedModelError(info.reason, arch=info.arch, start=start, end=end)
        header = read_header(model_path)
        if info.arch not in TORCH_ARCHS or header.get(f"{info.arch}.expert_count"):
            raise UnsupportedModelError(
                f"the PyTorch reference implements dense {', '.join(sorted(TORCH_ARCHS))} only, not {info.arch!r}"
                + (" with experts" if header.get(f"{info.arch}.expert_count") else ""),
                arch=info.arch, start=start, end=end)
        torch.set_num_threads(n_threads or os.cpu_count() or 1)
        self._torch = torch
        fields = {k: v for k, (_, _, v) in header.fields.items()}
        tensors = {
            name: gguf.quants.dequantize(header.tensor_bytes(name), gguf.GGMLQuantizationType(t.ggml_type))
            for name, t in header.tensors.items()
            if _wanted(name, start, end, info.n_layer)
        }
        self._args = ModelArgs.from_gguf(fields, info.n_vocab)
        self._model = ShardTransformer(self._args, tensors, start, end)
        self._info = info
        self._revision = model_revision(model_path)
        # bytes as stored in the GGUF, as llama.cpp's report gives them and the ledger pays them (this
        # backend holds float32); a route never mixes cache ABIs, so the cost model compares like with like
        self._weights = shard_weights(header, start, end)
        self.active_param_bytes = self._weights.active_bytes
        self._n_ctx = n_ctx
        slots = sessions_for_memory(kv_memory, self._kv_per_token(), n_ctx)
        self._sessions = SlotTable(slots if max_sessions is None else max(1, min(slots, max_sessions)),
                                      constraint=lambda c: TokenConstraint(c, materialize_vocabulary(model_path)))
        self._caches: dict[str, list] = {}
        self._weight_bytes = sum(int(v.nbytes) for v in tensors.values())
        self._closed = False

    @property
    def layers(self) -> ShardRange:
        return self._layers

    @property
    def hidden_size(self) -> int:
        return self._info.n_embd

    @property
    def n_vocab(self) -> int:
        """Vocabulary size of the model."""
        return self._info.n_vocab

    def _kv_per_token(self) -> int:
        return self._layers.n_layers * 2 * self._args.n_kv_head * self._args.head_dim * 4

    def capability(self) -> CapabilityReport:
        """What this shard can do and how fast it has been."""
        return CapabilityReport(
            model_arch=self._info.arch,
            model_name=self._info.name,
            model_revision=self._revision,
            runtime="torch",
            layers=self._layers,
            hidden_size=self._info.n_embd,
            vocab_size=self._info.n_vocab,
            n_ctx=self._n_ctx,
            supports_layer_range=self._info.splittable,
            cache_abi=f"torch/kv-f32/{self._info.arch}",
            cache_bytes_per_token=self._kv_per_token(),
            memory_floor_bytes=self._weight_bytes,
            max_sessions=self._sessions.max_sessions,
            param_bytes=self._weights.param_bytes,
            active_param_bytes_per_token=self._weights.active_bytes,
            expert_count=self._info.expert_count,
            expert_used_count=self._info.expert_used_count,
        )

    def open_session(self, session_id: str, sampling: SamplingParams | None = None) -> None:
        """Allocate an empty per-session KVCache list."""
        self._check_open()
        self._sessions.open(session_id, sampling)
        self._caches[session_id] = self._model.new_cache()

    def adopt_session(self, old_id: str, new_id: str, keep: int, sampling: SamplingParams | None = None) -> None:
        """Continue `old_id` as `new_id` with its caches; rows past `keep` are written over."""
        self._check_open()
        self._sessions.rename(old_id, new_id, keep, sampling)
        self._caches[new_id] = self._caches.pop(old_id)

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
            state, position, self._layers, hidden_size=self._info.n_embd, n_vocab=self._info.n_vocab,
            n_ctx=self._n_ctx, token_ids=token_ids, hidden=hidden,
        )
        return self._run(state, position, rows, sample=True, want_logits=want_logits)

    def forward_batch(self, parts: list[BatchPart]) -> list[PartResult]:
        """The batched call: each part runs on its own (the reference backend loops inside);
        a part that fails its checks fails alone."""
        self._check_open()
        results: list[PartResult] = []
        seen: set[str] = set()
        head = self._layers.is_head
        for part in parts:
            try:
                state = self._sessions.get(part.session_id)
                if part.session_id in seen:
                    raise EngineError(f"session {part.session_id!r} has two parts in one batch")
                # routes with a torch hop never draft (not "exact"); every decode step may rewind
                # (BatchPart.rewind), which only a step behind the session's position does
                if part.drafts is not None or (part.rewind and part.position < state.position):
                    raise EngineError("the torch reference backend runs no verify steps")
                rows = check_forward(
                    state, part.position, self._layers, hidden_size=self._info.n_embd,
                    n_vocab=self._info.n_vocab, n_ctx=self._n_ctx,
                    token_ids=part.rows if head else None, hidden=None if head else part.rows,
                )
                seen.add(part.session_id)
                results.append(self._run(state, part.position, rows, sample=part.sample,
                                         want_logits=part.want_logits))
            except EngineError as exc:
                results.append(exc)
        return results

    def _run(self, state: SlotState, position: int, rows: np.ndarray, *, sample: bool,
             want_logits: bool) -> ShardOutput:
        x = self._torch.from_numpy(rows.astype(np.int64) if self._layers.is_head else rows)
        out = self._model(x, position, self._caches[state.session_id]).numpy()
        state.position = position + len(rows)
        if not self._layers.is_tail:
            return ShardOutput(hidden=np.ascontiguousarray(out, dtype=np.float32))
        if not sample:
            return ShardOutput()
        token = state.sampler.choose(out, token_rng(state.sampling, state.position, state.rng))
        return ShardOutput(token=token, logits=out.astype(np.float32) if want_logits else None)

    def position(self, session_id: str) -> int:
        """The session's next position."""
        return self._sessions.get(session_id).position

    def cache_bytes(self, session_id: str) -> int:
        """Bytes of KV the session holds (tokens × bytes per token)."""
        return self._sessions.get(session_id).position * self._kv_per_token()

    def close_session(self, session_id: str) -> None:
        """Drop the session's KVCache list."""
        self._sessions.close(session_id)
        self._caches.pop(session_id, None)

    def sessions(self) -> list[str]:
        """Open session ids."""
        return self._sessions.ids()

    def close(self) -> None:
        """Free the weights and every session."""
        self._closed = True
        self._caches.clear()
        for sid in self._sessions.ids():
            self._sessions.close(sid)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")
