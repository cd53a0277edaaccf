"""Llama architecture for one Shard in PyTorch: the reference backend's model math, in one file.

gpt-fast style: a config dataclass, a KVCache with one `update()`, short forward bodies with
shape comments, names that follow the GGUF tensors. Weights are the GGUF's own tensors,
dequantized to float32. llama.cpp's GGUF q/k weights are permuted for its "normal" RoPE mode,
which rotates ADJACENT pairs (2i, 2i+1); `apply_rope` does the same, so no un-permute is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(slots=True)
class ModelArgs:
    """Hyperparameters read from a llama GGUF's metadata."""

    n_layer: int
    dim: int
    n_head: int
    n_kv_head: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float
    rope_base: float
    head_dim: int = 0

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.dim // self.n_head

    @classmethod
    def from_gguf(cls, fields: dict[str, Any], vocab_size: int) -> ModelArgs:
        """Build from GGUF key/values of a llama model (`llama.*`)."""
        a = str(fields["general.architecture"])
        return cls(
            n_layer=int(fields[f"{a}.block_count"]),
            dim=int(fields[f"{a}.embedding_length"]),
            n_head=int(fields[f"{a}.attention.head_count"]),
            n_kv_head=int(fields.get(f"{a}.attention.head_count_kv") or fields[f"{a}.attention.head_count"]),
            ffn_dim=int(fields[f"{a}.feed_forward_length"]),
            vocab_size=vocab_size,
            norm_eps=float(fields[f"{a}.attention.layer_norm_rms_epsilon"]),
            rope_base=float(fields.get(f"{a}.rope.freq_base") or 10000.0),
            head_dim=int(fields.get(f"{a}.attention.key_length") or 0),
        )


class KVCache:
    """One layer's keys and values for one session; grows by doubling."""

    def __init__(self, n_kv_head: int, head_dim: int, capacity: int = 256) -> None:
        self.k = torch.zeros(1, n_kv_head, capacity, head_dim)  # [B, Hkv, S, D]
        self.v = torch.zeros(1, n_kv_head, capacity, head_dim)

    def update(self, pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, n, D] at `pos`; return all keys/values [B, Hkv, pos+n, D]."""
        end = pos + k.shape[2]
        if end > self.k.shape[2]:
            grow = max(end, 2 * self.k.shape[2])
            self.k = F.pad(self.k, (0, 0, 0, grow - self.k.shape[2]))
            self.v = F.pad(self.v, (0, 0, 0, grow - self.v.shape[2]))
        self.k[:, :, pos:end] = k
        self.v[:, :, pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def nbytes(self, n_tokens: int) -> int:
        """Bytes holding n_tokens of keys and values."""
        return 2 * self.k.shape[1] * n_tokens * self.k.shape[3] * self.k.element_size()


def rope_freqs(args: ModelArgs, factors: Tensor | None = None) -> Tensor:
    """Per-pair rotation frequencies [head_dim/2] (llama3 rope factors divide them)."""
    freqs = 1.0 / (args.rope_base ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    if factors is not None:
        freqs = freqs / factors.double()
    return freqs


def apply_rope(x: Tensor, pos: Tensor, freqs: Tensor) -> Tensor:
    """Rotate adjacent pairs of x [B, S, H, D] by pos [S] × freqs [D/2] (llama.cpp NORM mode)."""
    angles = pos.double()[:, None] * freqs[None, :]  # [S, D/2]
    cos = angles.cos().float()[None, :, None, :]  # [1, S, 1, D/2]
    sin = angles.sin().float()[None, :, None, :]
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # [B, S, H, D/2] each
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, weight: Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight, requires_grad=False), eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, w: dict[str, Tensor]) -> None:
        super().__init__()
        self.args = args
        self.wq, self.wk, self.wv, self.wo = w["attn_q"], w["attn_k"], w["attn_v"], w["attn_output"]

    def forward(self, x: Tensor, pos: Tensor, freqs: Tensor, cache: KVCache, mask: Tensor) -> Tensor:
        a = self.args
        b, s, _ = x.shape  # x: [B, S, dim]
        q = F.linear(x, self.wq).view(b, s, a.n_head, a.head_dim)
        k = F.linear(x, self.wk).view(b, s, a.n_kv_head, a.head_dim)
        v = F.linear(x, self.wv).view(b, s, a.n_kv_head, a.head_dim)
        q, k = apply_rope(q, pos, freqs), apply_rope(k, pos, freqs)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        k, v = cache.update(int(pos[0]), k, v)  # [B, Hkv, T, D]
        rep = a.n_head // a.n_kv_head
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, S, D]
        return F.linear(y.transpose(1, 2).reshape(b, s, -1), self.wo)


class FeedForward(nn.Module):
    def __init__(self, w: dict[str, Tensor]) -> None:
        super().__init__()
        self.w_gate, self.w_up, self.w_down = w["ffn_gate"], w["ffn_up"], w["ffn_down"]

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up), self.w_down)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, w: dict[str, Tensor]) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(w["attn_norm"], args.norm_eps)
        self.attn = Attention(args, w)
        self.ffn_norm = RMSNorm(w["ffn_norm"], args.norm_eps)
        self.ffn = FeedForward(w)

    def forward(self, x: Tensor, pos: Tensor, freqs: Tensor, cache: KVCache, mask: Tensor) -> Tensor:
        h = x + self.attn(self.attn_norm(x), pos, freqs, cache, mask)  # [B, S, dim]
        return h + self.ffn(self.ffn_norm(h))


class ShardTransformer(nn.Module):
    """Layers [start, end) of a llama model; embeds on the head, norm + LM head on the tail."""

    def __init__(self, args: ModelArgs, tensors: dict[str, np.ndarray], start: int, end: int) -> None:
        super().__init__()
        self.args, self.start, self.end = args, start, end
        t = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in tensors.items()}  # own, writable copies
        self.tok_embeddings = t["token_embd.weight"] if start == 0 else None  # [vocab, dim]
        self.layers = nn.ModuleList(TransformerBlock(args, _block(t, i)) for i in range(start, end))
        tail = end == args.n_layer
        self.norm = RMSNorm(t["output_norm.weight"], args.norm_eps) if tail else None
        self.output = t.get("output.weight", t["token_embd.weight"]) if tail else None  # [vocab, dim]
        self.freqs = rope_freqs(args, t.get("rope_freqs.weight"))

    def new_cache(self) -> list[KVCache]:
        """An empty Hot KV State for one session: one KVCache per layer of the shard."""
        return [KVCache(self.args.n_kv_head, self.args.head_dim) for _ in self.layers]

    @torch.inference_mode()
    def forward(self, x: Tensor, pos: int, cache: list[KVCache]) -> Tensor:
        """x: token ids [S] on the head, else hidden [S, dim] → hidden [S, dim] or last-row logits [vocab]."""
        h = F.embedding(x, self.tok_embeddings) if self.tok_embeddings is not None else x
        h = h[None]  # [1, S, dim]
        s = h.shape[1]
        positions = torch.arange(pos, pos + s)
        mask = torch.ones(s, pos + s, dtype=torch.bool).tril(diagonal=pos)  # [S, T] causal
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = layer(h, positions, self.freqs, layer_cache, mask)
        if self.norm is None:
            return h[0]
        return F.linear(self.norm(h[0, -1]), self.output)  # [vocab]


def _block(t: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    """The weights of GGUF block i keyed by their short names (attn_q, ffn_down, ...)."""
    prefix = f"blk.{i}."
    return {k[len(prefix):].removesuffix(".weight"): v for k, v in t.items() if k.startswith(prefix)}
