"""What each GGUF architecture needs for an exact layer range, declared once (pure data).

A layer range runs as a shard file (artifacts/shard_file.py) whose first layer takes hidden
rows through llama.cpp's embedding input and whose output is captured after its last layer.
Two things differ per architecture, both in llama.cpp's graph builder for it:

- whether the builder records each layer's input (`t_layer_inp`), which
  `llama_set_embeddings_layer_inp` hands out; where it does not, asking for it aborts the
  process (GGML_ASSERT "layer input tensor is null"), and the shard captures `l_out-<il>`
  through an eval callback instead;
- whether the embedding input is used as given: an architecture that rescales it inside the
  graph (Gemma multiplies by sqrt(n_embd)) would rescale a middle hop's hidden rows again.

An architecture not listed here keeps `supports_layer_range=false`, with the reason. Every
listed one is proven exact by tests/test_architectures.py (tiny random-weight GGUFs, whole
model vs 2- and 3-way splits).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ArchSupport:
    """How a layer range of one architecture is cut and run exactly."""

    arch: str
    layer_input_capture: bool  # the graph builder records t_layer_inp (else: cb_eval on l_out)
    # the graph multiplies token embeddings by sqrt(n_embd), but not embeddings given as input:
    # the head, which looks its tokens up outside llama.cpp, applies the scale itself
    scales_token_embeddings: bool = False
    # llama.cpp derives sliding-window layers from the shard-local index (il % period <
    # period - 1); a shard file writes the pattern out per layer from the ORIGINAL indexes
    swa_period: int = 0


def swa_pattern(period: int, start: int, end: int) -> list[bool]:
    """Which of layers [start, end) use the sliding window, by their index in the whole model."""
    return [il % period < period - 1 for il in range(start, end)]


SPLITTABLE: dict[str, ArchSupport] = {
    a.arch: a
    for a in (
        ArchSupport("llama", layer_input_capture=True),
        ArchSupport("qwen2", layer_input_capture=False),
        ArchSupport("qwen3", layer_input_capture=False),
        ArchSupport("qwen3moe", layer_input_capture=False),
        ArchSupport("phi3", layer_input_capture=False),
        ArchSupport("gemma3", layer_input_capture=False, scales_token_embeddings=True, swa_period=6),
    )
}

NOT_SPLITTABLE: dict[str, str] = {  # known architectures and why not (yet)
    "gemma": "Gemma rescales the embedding input by sqrt(n_embd) inside the graph, so a middle hop's rows would be rescaled again",
    "gemma2": "Gemma rescales the embedding input inside the graph; softcapping and the sliding-window pattern are not described yet",
}


def arch_support(arch: str) -> ArchSupport | None:
    """The layer-range description of `arch`, or None when it cannot be cut exactly."""
    return SPLITTABLE.get(arch)


def split_reason(arch: str) -> str:
    """Why `arch` has no exact layer range ("" when it has one)."""
    if arch in SPLITTABLE:
        return ""
    return NOT_SPLITTABLE.get(arch) or (
        f"architecture {arch!r} has no exact layer-range support (supported: {', '.join(sorted(SPLITTABLE))})")
