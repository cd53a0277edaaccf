"""Output Constraint: the structure a session's answer must have (`response_format`), and the
grammar that says it (pure).

The gateway turns a request's `response_format` into an OutputConstraint; the Route Session
carries it in its sampling to the tail, which masks every token the grammar does not allow
before it samples (nodes/token_constraint.py). The grammar is llguidance's (a maintained
library of token masks: docs/gateway.md, "Structured output", says why this one). JSON is
written compactly (no whitespace between tokens outside strings): a small model otherwise
spends its tokens on spaces and newlines the grammar allows.
"""

from __future__ import annotations

import json
from typing import Literal

import llguidance
from pydantic import BaseModel, ConfigDict, Field

MAX_SCHEMA_BYTES = 64 * 1024
JSON_OPTIONS: llguidance.JsonCompileOptions = {"whitespace_flexible": False}


class OutputConstraint(BaseModel):
    """`json_object`: any JSON object; `json_schema`: a value valid against `schema_text`;
    `grammar`: text of llguidance's Lark grammar `grammar_text` (the gateway's, for a tool
    dialect's forced calls: gateway/tool_calls.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["json_object", "json_schema", "grammar"]
    schema_text: str = Field(default="", max_length=MAX_SCHEMA_BYTES)  # compact JSON of the schema
    grammar_text: str = Field(default="", max_length=4 * MAX_SCHEMA_BYTES)
    name: str = Field(default="", max_length=64)


def grammar_of(constraint: OutputConstraint) -> str:
    """The llguidance grammar of a constraint (ValueError: a schema that is not a JSON object)."""
    if constraint.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(constraint.grammar_text)
    schema = json.loads(constraint.schema_text) if constraint.kind == "json_schema" else {"type": "object"}
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
