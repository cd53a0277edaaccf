"""`response_format` of a chat or completion request -> the session's OutputConstraint (pure).

- `{"type": "text"}` (or none): no constraint.
- `{"type": "json_object"}`: any JSON object (llama-server's `"schema"` beside it narrows it).
- `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`: a value
  valid against the schema. The answer is constrained whether `strict` is set or not.
A schema the grammar compiler refuses (an unknown type, an unsupported keyword) is a 400 that
names `response_format`, like any malformed value.
"""

from __future__ import annotations

from typing import Any

import llguidance
import orjson

from gateway.errors import InvalidRequestError, check_known_keys
from schemas.output_constraint import MAX_SCHEMA_BYTES, OutputConstraint, grammar_of

PARAM = "response_format"


def _refuse(message: str, param: str = PARAM) -> InvalidRequestError:
    return InvalidRequestError(f"invalid {param}: {message}", param=param, code="invalid_value")


# the keys each object may hold; any other is a 400 naming it (a field never silently dropped).
# A json_schema's description is documentation for the client's own tools; no model reads it
KEYS = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}
SPEC_KEYS = {"name", "schema", "strict", "description"}


def output_constraint(raw: Any) -> OutputConstraint | None:
    """The constraint a request's `response_format` asks for (InvalidRequestError if malformed)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise _refuse('it must be an object with a "type": "text", "json_object" or "json_schema"')
    kind = raw["type"]
    if kind not in KEYS:
        raise _refuse(f'unknown type {kind!r}: use "text", "json_object" or "json_schema"')
    check_known_keys(raw, KEYS[kind], PARAM)
    if kind == "text":
        return None
    if kind == "json_object":
        schema = raw.get("schema")
        constraint = OutputConstraint(kind="json_object") if schema is None else _with_schema(schema, "")
    else:  # json_schema
        spec = raw.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _refuse('"json_schema" must be an object with a "schema"')
        check_known_keys(spec, SPEC_KEYS, f"{PARAM}.json_schema")
        if not isinstance(spec.get("description", ""), str):
            raise _refuse('"json_schema.description" must be a string')
        name = spec.get("name", "")
        if not isinstance(name, str) or len(name) > 64:
            raise _refuse('"json_schema.name" must be a string of at most 64 characters')
        if not isinstance(spec.get("strict", False), bool | None):
            raise _refuse('"json_schema.strict" must be a boolean')
        constraint = _with_schema(spec["schema"], name)
    check_compiles(constraint)
    return constraint


def _with_schema(schema: Any, name: str) -> OutputConstraint:
    if not isinstance(schema, dict):
        raise _refuse("the schema must be a JSON object")
    text = orjson.dumps(schema).decode()
    if len(text) > MAX_SCHEMA_BYTES:
        raise _refuse(f"the schema is {len(text)} bytes, more than {MAX_SCHEMA_BYTES}")
    return OutputConstraint(kind="json_schema", schema_text=text, name=name)


def check_compiles(constraint: OutputConstraint, param: str = PARAM) -> None:
    """Refuse (a 400 naming `param`) a constraint the grammar compiler refuses, before any
    route is asked for: a node would refuse the session, and no other node does better."""
    try:
        grammar = grammar_of(constraint)
    except ValueError as exc:
        raise _refuse(str(exc), param) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise _refuse(f"the schema is not supported: {messages[0] if messages else 'refused'}", param)
