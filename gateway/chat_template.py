"""Render a GGUF's `tokenizer.chat_template` (Jinja2, sandboxed) into a prompt string."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import InvalidRequestError


class TemplateError(InvalidRequestError):
    """The chat template refused the messages (it called raise_exception) or failed."""

    def __init__(self, message: str) -> None:
        super().__init__(f"chat template error: {message}", param="messages", code="template_error")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@dataclass(slots=True)
class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    source: str
    bos_token: str
    eos_token: str
    _compiled: jinja2.Template = field(init=False, repr=False)

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True
        )
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self._compiled = env.from_string(self.source)

    def render(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages`, ending with the assistant turn's opening; `variables`
        are more names the template sees (`tools`)."""
        try:
            return self._compiled.render(
                **(variables or {}),
                messages=list(messages),
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(str(exc)) from exc
