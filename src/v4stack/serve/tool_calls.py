"""Tool calls in the model's own format (V4's DSML block, ``v4stack.chat``), for whole texts and
for streams: content is released until the block starts, then each call is released as soon as
its ``invoke`` closes; a call cut off by the token limit comes out at the end as far as it got.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from v4stack.chat import DSML, parse_completion

BLOCK = f"\n\n<{DSML}tool_calls>"
INVOKE_END = f"</{DSML}invoke>"


@dataclass
class Call:
    name: str
    arguments: str  # a JSON object's text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def forced_prefix(name: str | None) -> str:
    """What the assistant's text starts with when a call is required (``name``: that function)."""
    head = BLOCK + "\n"
    return head + (f'<{DSML}invoke name="{name}">\n' if name else "")


def parse(text: str) -> tuple[str, list[Call]]:
    """Generated text -> (content, calls)."""
    r = parse_completion(text)
    return r["content"], [Call(c["function"]["name"], c["function"]["arguments"]) for c in r["tool_calls"]]


def _dump(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


class ToolStream:
    """Splits streamed text into content deltas and whole tool calls."""

    def __init__(self):
        self._pending = ""  # content that may be the start of BLOCK
        self._body: str | None = None  # text after BLOCK
        self.n_calls = 0

    def push(self, text: str, final: bool = False) -> tuple[str, list[Call]]:
        content = ""
        if self._body is None:
            buf = self._pending + text
            i = buf.find(BLOCK)
            if i < 0:
                keep = 0 if final else max((k for k in range(1, len(BLOCK)) if buf.endswith(BLOCK[:k])), default=0)
                self._pending = buf[len(buf) - keep:] if keep else ""
                return buf[: len(buf) - keep], []
            self._pending, self._body, content = "", buf[i + len(BLOCK):], buf[:i]
        else:
            self._body += text
        upto = len(self._body) if final else self._body.rfind(INVOKE_END) + len(INVOKE_END)
        if upto < len(INVOKE_END) and not final:
            return content, []
        _, calls = parse(BLOCK + self._body[:upto])
        new = calls[self.n_calls:]
        self.n_calls += len(new)
        return content, new
