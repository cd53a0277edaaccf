"""Mesh protocol versions: which messages a node's code reads, and what a message needs.

Nodes, trackers and gateways of different releases run in one mesh (each operator upgrades
when they do), and a reader validates strictly: a model with `extra="forbid"` (SamplingParams,
the Capability Report, a frame header) refuses a field it does not know, so a message with a
newer field is dropped whole by an older reader. The rule (docs/control-plane.md, "Mixed
versions"):

- `PROTOCOL` is this code's version; a node announces it (NodeAnnouncement.protocol; absent:
  protocol 1, a node from before it was announced).
- A field added to such a model after protocol 1 is declared with `since(n)` and subclasses
  `Versioned`: it is left out of the JSON while at its default, so an older reader accepts every
  message that does not use it (`needs` says which do).
- A route request whose sampling `needs` protocol n is routed only over nodes announcing at
  least n; when every route would cross an older node, the tracker refuses it `incompatible`,
  naming the nodes and both versions, before any frame is sent.

Versions: 1 up to commit e590058; 2 adds SamplingParams.order (llama-server's `samplers`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, SerializationInfo, SerializerFunctionWrapHandler, model_serializer

PROTOCOL = 2
FIRST = 1  # a node that announces no protocol


# what sets each field a newer protocol reads, for a refusal to name (a field's path in a request)
SET_BY = {"sampling.order": "sampling.order is llama-server's `samplers`: leave it out, or list the "
          "stages the request turns on in the order top_k, min_p, temperature, top_p"}


def what_sets(fields: tuple[str, ...]) -> str:
    """What in a client's request sets `fields` (pure): SET_BY's words, else the field's path."""
    return "; ".join(SET_BY.get(f, f) for f in fields)


def since(version: int) -> dict[str, Any]:
    """A field's `json_schema_extra`: the protocol that first reads it."""
    return {"since": version}


def field_since(model: type[BaseModel], name: str) -> int:
    """The protocol that first reads `model`'s field `name` (FIRST unless declared with since)."""
    extra = model.model_fields[name].json_schema_extra
    return int(extra.get("since", FIRST)) if isinstance(extra, dict) else FIRST


def _at_default(model: BaseModel, name: str) -> bool:
    info = type(model).model_fields[name]
    return bool(getattr(model, name) == info.get_default(call_default_factory=True))


def needs(model: BaseModel, prefix: str = "") -> tuple[int, tuple[str, ...]]:
    """The protocol every reader of `model` must have, and the fields that need it (pure; nested
    models included, named by their path): FIRST and () when it uses nothing newer."""
    version, fields = FIRST, ()
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            v, f = needs(value, f"{prefix}{name}.")
        elif field_since(type(model), name) > FIRST and not _at_default(model, name):
            v, f = field_since(type(model), name), (f"{prefix}{name}",)
        else:
            continue
        if v > version:
            version, fields = v, f
        elif v == version > FIRST:
            fields = (*fields, *f)
    return version, fields


class Versioned(BaseModel):
    """A strict model whose fields newer than protocol 1 are left out of its dump at their
    default, so older readers (which forbid unknown fields) accept it."""

    @model_serializer(mode="wrap")
    def _omit_newer_defaults(self, handler: SerializerFunctionWrapHandler,
                             _info: SerializationInfo) -> dict[str, Any]:
        data = handler(self)
        for name in type(self).model_fields:
            if field_since(type(self), name) > FIRST and name in data and _at_default(self, name):
                del data[name]
        return data
