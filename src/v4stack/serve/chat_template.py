"""The chat template: messages (and tools) -> prompt text.

The default is the model's own encoding (``v4stack.chat.encode_chat``: V4's chat mode, tool
schemas in the system text, DSML tool calls, tool results in the user turn).
``v4stack serve --chat-template`` replaces it with a Jinja template (a file or inline text),
rendered in a sandbox; it sees ``messages`` (role, content as text, name, tool_calls,
tool_call_id), ``tools`` (or none) and ``add_generation_prompt``.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from v4stack.chat import ChatFormatError, encode_chat


class ChatTemplate:
    def __init__(self, source: str | None = None):
        """``source``: a template file's path, an inline template, or None for the model's encoding."""
        self.template = None
        if not source:
            return
        p = Path(source)
        text = p.read_text() if p.is_file() else source
        if not p.is_file() and "{{" not in text and "{%" not in text:
            raise ValueError(f"--chat-template: {source!r} is neither a file nor a Jinja template")
        env = ImmutableSandboxedEnvironment(keep_trailing_newline=True)
        try:
            self.template = env.from_string(text)
        except TemplateError as e:
            raise ValueError(f"--chat-template: {e}") from None

    def render(self, messages: list[dict], tools: list[dict] | None, prefix: str = "") -> str:
        """The prompt text; ``prefix`` starts the assistant's reply (a forced tool call).
        Raises ValueError naming the field when the messages cannot be encoded."""
        if self.template is None:
            try:
                return encode_chat(messages, tools=tools or None) + prefix
            except ChatFormatError as e:
                raise ValueError(str(e)) from None
        try:
            return self.template.render(messages=messages, tools=tools or None, add_generation_prompt=True) + prefix
        except TemplateError as e:
            raise ValueError(f"messages: the chat template failed: {e}") from None
