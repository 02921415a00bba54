"""The chat template: messages (and tools) -> prompt text, a Jinja template in a sandbox.

The default is the project's byte-level format: one ``<|role|>`` line per message, then the
assistant tag; with tools, a system line listing them and the model's tool-call format for
assistant turns that called tools. ``v4stack serve --chat-template FILE`` replaces it; the
template sees ``messages`` (role, content as text, name, tool_calls, tool_call_id), ``tools``
(the request's list, or none), ``add_generation_prompt`` and the tool-call markers.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from v4stack.serve import tool_calls as tc

DEFAULT = (
    "{% if tools %}<|system|>Tools you may call, one JSON schema per line. To call, write "
    "{{ calls_begin }}{{ call_begin }}NAME{{ tool_sep }}JSON ARGUMENTS{{ call_end }}{{ calls_end }}"
    "{% for t in tools %}{{ nl }}{{ t | tojson }}{% endfor %}{{ nl }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% if m.tool_calls %}{{ calls_begin }}{% for c in m.tool_calls %}{{ call_begin }}{{ c.function.name }}"
    "{{ tool_sep }}{{ c.function.arguments }}{{ call_end }}{% endfor %}{{ calls_end }}{% endif %}{{ nl }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class ChatTemplate:
    def __init__(self, source: str | None = None):
        """``source``: a template file's path, an inline template, or None for the default."""
        text = DEFAULT
        if source:
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
        """The prompt text; ``prefix`` is appended after the generation prompt (a forced tool call)."""
        try:
            out = self.template.render(messages=messages, tools=tools or None, add_generation_prompt=True, nl="\n",
                                       calls_begin=tc.CALLS_BEGIN, calls_end=tc.CALLS_END,
                                       call_begin=tc.CALL_BEGIN, call_end=tc.CALL_END, tool_sep=tc.SEP)
        except TemplateError as e:
            raise ValueError(f"messages: the chat template failed: {e}") from None
        return out + prefix
