"""Capability Report: what a node's backend can do for one Shard."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# How a llama.cpp node builds its KV cache and attention (docs/shard-runtime.md, "KV profiles"):
# "default": f16 K and V, flash attention off; "exact": flash attention on and a q8_0 K cache,
# with which a row's arithmetic does not depend on the other rows of its model call, so a batched
# prefill of decoded tokens rebuilds their KV and logits bit for bit (a restart's batched replay)
KvProfile = Literal["default", "exact"]
KV_PROFILES: tuple[KvProfile, ...] = ("default", "exact")
# a node's --ctx (tokens per session; llama.cpp allocates the KV for all of them) and its default
MIN_CTX, MAX_CTX, DEFAULT_CTX = 16, 1 << 20, 2048
Q8_0_BLOCK = 32  # values per q8_0 block: llama.cpp quantizes a K row in blocks of this many


def exact_fits(head_dim: int) -> bool:
    """Whether a model's K rows can be stored as q8_0, which the exact profile needs: its head
    dimension must be a multiple of the block (pure)."""
    return head_dim > 0 and head_dim % Q8_0_BLOCK == 0


def usual_kv_profile(head_dim: int) -> KvProfile:
    """A llama.cpp node's KV profile when none is asked for: exact wherever the model allows it."""
    return "exact" if exact_fits(head_dim) else "default"


class ShardRange(BaseModel):
    """A half-open layer range [start, end) of a model with n_layer layers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: int = Field(ge=0)
    end: int = Field(gt=0)
    n_layer: int = Field(gt=0)

    @model_validator(mode="after")
    def _check(self) -> ShardRange:
        if not (self.start < self.end <= self.n_layer):
            raise ValueError(
                f"layer range [{self.start}, {self.end}) is not inside [0, {self.n_layer})"
            )
        return self

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.n_layer

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"[{self.start},{self.end})/{self.n_layer}"


class CapabilityReport(BaseModel):
    """What a backend can do with one shard, and how fast it measured itself."""

    model_config = ConfigDict(extra="forbid")

    model_arch: str
    model_name: str
    model_revision: str  # content hash of the full GGUF the shard was cut from
    runtime: Literal["llama.cpp", "torch"]
    layers: ShardRange
    hidden_size: int
    vocab_size: int
    n_ctx: int
    supports_prefill: bool = True
    supports_decode_step: bool = True
    supports_layer_range: bool = True
    supports_partial_artifacts: bool = False
    cache_abi: str  # e.g. "llama.cpp/f16/kv-unified"; routes never mix ABIs on one model
    cache_bytes_per_token: int
    kv_profile: KvProfile = "default"  # announcements from before the field are "default"
    prefill_tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    memory_floor_bytes: int = 0
    max_sessions: int = 1
    # the weight bytes of the shard's layers and how many of them one token reads
    # (artifacts/shard_file.py shard_weights): a MoE layer's token reads its router, its shared
    # tensors and expert_used_count / expert_count of the stacked expert tensors; a dense shard
    # reads all. The tracker prices a hop nobody has measured by them (tracker/routing.py), the
    # ledger pays work by them. 0 = not reported (announcements from before these fields)
    param_bytes: int = Field(default=0, ge=0)
    active_param_bytes_per_token: int = Field(default=0, ge=0)
    expert_count: int = Field(default=0, ge=0)  # per MoE layer; 0 = dense
    expert_used_count: int = Field(default=0, ge=0)
