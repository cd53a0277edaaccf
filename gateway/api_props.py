"""GET /props: llama-server's description of the server, which its web UI reads at start (the
context size, the default generation settings it fills its settings with, the chat template it
scans for thinking support, the modalities it offers attachments for, the model's name).

Every value is what this gateway does; a field it cannot state (slots, a speculative draft
model, llama.cpp's build, the tuning of samplers it does not implement) is left out."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from aiohttp import web

from gateway.sampler_order import PIPELINE
from gateway.served_model import ServedModel
from gateway.state import MESH, MODEL

# what a request that sets nothing gets here, in llama-server's names: no token limit (-1: to an
# end-of-generation token or a full context), temperature 1 and every sampler off; the samplers
# this gateway does not implement at their "disabled" values (gateway/neutral_params.py), and
# the tail's own order of its samplers (a request's `samplers` may give another: gateway/sampler_order.py)
DEFAULT_PARAMS: dict[str, Any] = {
    "n_predict": -1, "max_tokens": -1, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repeat_penalty": 1.0, "typ_p": 1.0, "typical_p": 1.0,
    "mirostat": 0, "dynatemp_range": 0.0, "xtc_probability": 0.0, "dry_multiplier": 0.0, "top_n_sigma": -1.0,
    "n_probs": 0, "min_keep": 0, "ignore_eos": False, "stream": False, "stop": [], "grammar": "",
    "reasoning_format": "none", "samplers": list(PIPELINE),
}


def _build_info() -> str | None:
    try:
        return f"meshnet {importlib.metadata.version('meshnet')}"
    except importlib.metadata.PackageNotFoundError:
        return None


def server_props(served: ServedModel, model_name: str, n_ctx: int, build_info: str | None) -> dict[str, Any]:
    """The /props answer (pure): `model_name` the id clients use, `n_ctx` the context a prompt
    must fit (the widest chain of the mesh's nodes, MeshView.context_of)."""
    template = served.tokenizer.template
    props: dict[str, Any] = {
        "default_generation_settings": {"n_ctx": n_ctx, "params": dict(DEFAULT_PARAMS)},
        "model_path": str(served.path),
        "model_alias": model_name,
        "role": "model",  # one model, not llama-server's router of many
        "modalities": {"vision": False, "audio": False},  # text only
        "chat_template": template.source,
        "bos_token": template.bos_token,
        "eos_token": template.eos_token,
    }
    if build_info is not None:
        props["build_info"] = build_info
    return props


async def props(request: web.Request) -> web.Response:
    """GET /props (any query, llama-server's router's `model` and `autoload` among them, names
    this gateway's one model)."""
    served, mesh = request.app[MODEL], request.app[MESH]
    name = served.public_name(mesh.find(served.revision))
    return web.json_response(server_props(served, name, mesh.context_of(served.revision), _build_info()))
