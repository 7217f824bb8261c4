"""Render the GGUF's chat template in a sandbox.

A GGUF is untrusted input, so its Jinja template runs in jinja2's ImmutableSandboxedEnvironment, and
any reach for an unsafe attribute (`''.__class__` and the like) is an error, not a silent Undefined.
"""
from __future__ import annotations

from datetime import datetime
from functools import cached_property
from typing import Sequence

from jinja2 import TemplateError
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from models.errors import BadInputError


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but touching an unsafe attribute raises at once."""

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__} is not allowed")


_SYSTEM_PROBE = "kvchat: is this system message shown?"


def _raise_exception(message: str):
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise BadInputError(f"the model's chat template does not parse: {_one_line(e)}") from None

    @cached_property
    def supports_system_role(self) -> bool:
        """Does the template show a system message? Gemma 2's raises on one, and some templates drop
        it: llama.cpp (common/chat.cpp, its template caps check) then merges the system text into the
        first user message, and so does render."""
        probe = [{"role": "system", "content": _SYSTEM_PROBE}, {"role": "user", "content": "User message"}]
        try:
            return _SYSTEM_PROBE in self._template.render(messages=probe, add_generation_prompt=True,
                                                          bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception:
            return False

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """messages: [{"role": "system"|"user"|"assistant", "content": str}, ...] -> prompt text. A
        leading system message the template cannot show goes in front of the next message's text,
        joined by a newline (alone, it is dropped), as llama.cpp does."""
        messages = list(messages)
        if messages and messages[0]["role"] == "system" and not self.supports_system_role:
            system, messages = messages[0], messages[1:]
            if messages:
                messages[0] = {**messages[0], "content": system["content"] + "\n" + messages[0]["content"]}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except SecurityError as e:
            raise BadInputError(f"the model's chat template tried something unsafe and was stopped: {_one_line(e)}") from None
        except Exception as e:
            raise BadInputError(f"the model's chat template failed: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def transcript(messages: Sequence[dict]) -> str:
    """A conversation as plain text, for a model without a chat template: messages joined by blank
    lines, except that a reply continues the text before it, as the model wrote it (so the next
    turn's prompt starts with what the KV cache already holds, reply included)."""
    parts: list[str] = []
    for m in messages:
        if m["content"]:
            if parts and m["role"] != "assistant":
                parts.append("\n\n")
            parts.append(m["content"])
    return "".join(parts)
