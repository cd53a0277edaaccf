"""The Vocabulary File: a model's metadata, tokenizer included, without a tensor.

Shard files carry no tokenizer (artifacts/shard_file.py): shards never see text. A tail that
constrains a session's output (nodes/token_constraint.py) must know what text each token is,
so it loads this file with llama.cpp in vocab-only mode. It is written once per model revision
from the model's header alone, so a node that holds only its shard's pieces can write it too.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from artifacts.revision import cache_dir
from artifacts.source import ModelSource, open_source

FORMAT_VERSION = 1


def vocabulary_path(model: str | Path | ModelSource) -> Path:
    """Where the model's Vocabulary File is cached (by model revision)."""
    return cache_dir() / "vocab" / f"{open_source(model).revision}-v{FORMAT_VERSION}.gguf"


def materialize_vocabulary(model: str | Path | ModelSource) -> Path:
    """The model's Vocabulary File, written the first time."""
    import gguf

    src = open_source(model)
    target = vocabulary_path(src)
    if target.exists():
        return target
    h = src.full_header()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch=str(h.get("general.architecture")))
        for name, (vtype, item, value) in h.fields.items():
            if name == "general.architecture" or name.startswith("GGUF."):
                continue
            sub = gguf.GGUFValueType(item) if item is not None else None
            writer.add_key_value(name, value, gguf.GGUFValueType(vtype), sub_type=sub)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp, 0o644)  # the cache is shared by the machine's nodes
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
