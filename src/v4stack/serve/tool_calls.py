"""The model's tool-call format and its parser (whole text and streamed).

DeepSeek's chat format writes tool calls after the content as

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

with ARGUMENTS a JSON object. The parser returns the content before the calls and one
OpenAI ``tool_calls`` entry per complete or truncated call; arguments are passed on as written
(OpenAI's own API documents that they may not be valid JSON).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


@dataclass
class Call:
    name: str
    arguments: str
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def _calls(body: str, final: bool) -> tuple[list[Call], str]:
    """Complete calls in ``body`` (the text after CALLS_BEGIN) and the unparsed rest; with
    ``final`` a truncated last call is returned as far as it got."""
    calls = []
    while True:
        i = body.find(CALL_BEGIN)
        if i < 0:
            break
        j = body.find(CALL_END, i)
        if j < 0:
            if final:
                name, _, args = body[i + len(CALL_BEGIN):].partition(SEP)
                if name.strip():
                    calls.append(Call(name.strip(), args.removesuffix(CALLS_END)))
                body = ""
            break
        name, _, args = body[i + len(CALL_BEGIN): j].partition(SEP)
        calls.append(Call(name.strip(), args.strip()))
        body = body[j + len(CALL_END):]
    return calls, body


def parse(text: str) -> tuple[str, list[Call]]:
    """``text`` -> (content, calls)."""
    i = text.find(CALLS_BEGIN)
    if i < 0:
        return text, []
    calls, _ = _calls(text[i + len(CALLS_BEGIN):], final=True)
    return text[:i], calls


class ToolStream:
    """Splits streamed text into content deltas and whole tool calls as each one completes."""

    def __init__(self):
        self._pending = ""  # content that may be the start of CALLS_BEGIN
        self._body: str | None = None  # text after CALLS_BEGIN
        self.n_calls = 0

    def push(self, text: str, final: bool = False) -> tuple[str, list[Call]]:
        if self._body is None:
            buf = self._pending + text
            i = buf.find(CALLS_BEGIN)
            if i < 0:
                keep = 0 if final else max((k for k in range(1, len(CALLS_BEGIN)) if buf.endswith(CALLS_BEGIN[:k])),
                                           default=0)
                self._pending = buf[len(buf) - keep:] if keep else ""
                return buf[: len(buf) - keep], []
            self._pending, self._body = "", buf[i + len(CALLS_BEGIN):]
            content = buf[:i]
        else:
            content, self._body = "", self._body + text
        calls, self._body = _calls(self._body, final)
        self.n_calls += len(calls)
        return content, calls
