"""V4's chat encoding: OpenAI-style messages -> the prompt text the model was trained on, and a
completion's text -> (reasoning, content, tool calls).

    encode_chat(messages, thinking=False, tools=None, reasoning_effort=None) -> str
    parse_completion(text, thinking=False) -> {"content", "reasoning_content", "tool_calls"}

Format: ``<｜begin▁of▁sentence｜>``, then the system text (tool schemas appended), each user turn
as ``<｜User｜>text``; after the last user turn ``<｜Assistant｜>`` and ``<think>`` (thinking mode)
or ``</think>`` (chat mode). A past assistant turn is ``content<｜end▁of▁sentence｜>`` after
``</think>``; in thinking mode the reasoning of turns before the last user turn is dropped (kept
when tools are in play), later ones are written as ``reasoning</think>content``. Tool calls follow
the content as a DSML block; tool results come back inside the next user turn as
``<tool_result>...</tool_result>``.

Every field is checked: a message that carries one of the format's control strings, an unknown
role, a tool call whose arguments are not a JSON object, a tool result with no call before it, all
raise ``ChatFormatError`` naming the field (``messages[2].content`` ...). The byte tokenizer
encodes the control strings as plain bytes; a ``tokenizer.json`` maps them to their special ids.
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
RESERVED = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML, "<tool_result>", "</tool_result>")

EFFORT = {
    None: "",
    "low": "",
    "high": ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your "
             "thinking and comprehensively decompose the problem to resolve the root cause, rigorously "
             "stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
             "Explicitly write out your entire deliberation process, documenting every intermediate step, "
             "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
             "unchecked.\n\n"),
}
# The tool instructions as the released model was trained on them (its wording, so kept verbatim).
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{d}tool_calls>" block like the following:

<{d}tool_calls>
<{d}invoke name="$TOOL_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$TOOL_NAME2">
...
</{d}invoke>
</{d}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside {think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class ChatFormatError(ValueError):
    """A message cannot be encoded; the message names the field."""


def _text(v: Any, field: str) -> str:
    if v is None:
        return ""
    if isinstance(v, list):  # OpenAI content parts: text only
        parts = []
        for i, p in enumerate(v):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ChatFormatError(f"{field}[{i}]: only text content parts are supported")
            parts.append(p["text"])
        v = "\n".join(parts)
    if not isinstance(v, str):
        raise ChatFormatError(f"{field}: must be a string")
    for r in RESERVED:
        if r in v:
            raise ChatFormatError(f"{field}: contains the reserved control string {r!r}")
    return v


def _json(v: Any, field: str) -> str:
    try:
        out = json.dumps(v, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ChatFormatError(f"{field}: not JSON-serialisable ({e})") from e
    return _text(out, field)


def _name(v: Any, field: str) -> str:
    s = _text(v, field)
    if not s or any(c in s for c in '"<>\r\n'):
        raise ChatFormatError(f"{field}: must be a non-empty name without quotes, angle brackets or newlines")
    return s


def _tools_block(tools: list, field: str) -> str:
    if not isinstance(tools, list) or not tools:
        raise ChatFormatError(f"{field}: must be a non-empty list of function tools")
    schemas = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise ChatFormatError(f"{field}[{i}]: must be {{'type': 'function', 'function': {{...}}}}")
        _name(fn.get("name"), f"{field}[{i}].function.name")
        schemas.append(_json(fn, f"{field}[{i}].function"))
    return TOOLS_TEMPLATE.format(d=DSML, think=THINK, end_think=END_THINK, schemas="\n".join(schemas))


def _tool_calls(calls: Any, field: str) -> str:
    if not isinstance(calls, list) or not calls:
        raise ChatFormatError(f"{field}: must be a non-empty list")
    out = []
    for i, c in enumerate(calls):
        f = f"{field}[{i}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            raise ChatFormatError(f"{f}.function: missing")
        name = _name(fn.get("name"), f"{f}.function.name")
        raw = fn.get("arguments", "{}")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"{f}.function.arguments: not JSON ({e})") from e
        if not isinstance(args, dict):
            raise ChatFormatError(f"{f}.function.arguments: must be a JSON object")
        params = []
        for k, v in args.items():
            key = _name(k, f"{f}.function.arguments.{k}")
            is_str = isinstance(v, str)
            val = _text(v, f"{f}.function.arguments.{k}") if is_str else _json(v, f"{f}.function.arguments.{k}")
            params.append(f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">{val}</{DSML}parameter>')
        out.append(f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(out) + f"\n</{DSML}tool_calls>"


def _turns(messages: list, tools: list | None) -> list[dict]:
    """Normalised turns: system / user (text and tool results merged) / assistant."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages: must be a non-empty list")
    turns: list[dict] = []
    open_calls = 0
    for i, m in enumerate(messages):
        f = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatFormatError(f"{f}: must be an object")
        role = m.get("role")
        if role in ("system", "developer"):
            turns.append({"role": "system", "text": _text(m.get("content"), f"{f}.content")})
        elif role == "user":
            text = _text(m.get("content"), f"{f}.content")
            if turns and turns[-1]["role"] == "user":
                turns[-1]["parts"].append(text)
            else:
                turns.append({"role": "user", "parts": [text]})
            open_calls = 0
        elif role == "tool":
            if open_calls == 0:
                raise ChatFormatError(f"{f}: a tool result needs an assistant tool call before it")
            part = "<tool_result>" + _text(m.get("content"), f"{f}.content") + "</tool_result>"
            if turns and turns[-1]["role"] == "user":
                turns[-1]["parts"].append(part)
            else:
                turns.append({"role": "user", "parts": [part]})
        elif role == "assistant":
            calls = m.get("tool_calls")
            turns.append({"role": "assistant", "text": _text(m.get("content"), f"{f}.content"),
                          "reasoning": _text(m.get("reasoning_content"), f"{f}.reasoning_content"),
                          "calls": _tool_calls(calls, f"{f}.tool_calls") if calls else ""})
            open_calls = len(calls) if calls else 0
        else:
            raise ChatFormatError(f"{f}.role: must be system, user, assistant or tool, got {role!r}")
    if tools:
        block = _tools_block(tools, "tools")
        if turns[0]["role"] != "system":  # as an empty system message carrying the tools
            turns.insert(0, {"role": "system", "text": ""})
        turns[0]["text"] += "\n\n" + block
    return turns


def encode_chat(messages: list, thinking: bool = False, tools: list | None = None,
                reasoning_effort: str | None = None, add_bos: bool = True) -> str:
    """The prompt text for ``messages``, ending with the assistant's opening when the last turn
    is a user turn (or tool results)."""
    if reasoning_effort not in EFFORT:
        raise ChatFormatError(f"reasoning_effort: must be one of {[k for k in EFFORT if k]}, got {reasoning_effort!r}")
    turns = _turns(messages, tools)
    last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=-1)
    keep_reasoning = bool(tools)  # a tool-using turn keeps its reasoning across the tool results
    out = [BOS if add_bos else "", EFFORT[reasoning_effort] if thinking else ""]
    for i, t in enumerate(turns):
        if t["role"] == "system":
            out.append(t["text"])
        elif t["role"] == "user":
            out.append(USER + "\n\n".join(t["parts"]))
            if i + 1 == len(turns) or turns[i + 1]["role"] == "assistant":
                out.append(ASSISTANT + (THINK if thinking and (keep_reasoning or i == last_user) else END_THINK))
        else:
            if thinking and (keep_reasoning or i > last_user):
                out.append(t["reasoning"] + END_THINK)
            out.append(t["text"] + t["calls"] + EOS)
    return "".join(out)


def parse_completion(text: str, thinking: bool = False) -> dict:
    """Split generated text (after the prompt) into reasoning, content and tool calls. A missing
    EOS (a length-limited completion) leaves the content as generated."""
    reasoning = ""
    if thinking:
        head, sep, text = text.partition(END_THINK)
        if not sep:  # still thinking when generation stopped
            return {"content": "", "reasoning_content": head, "tool_calls": []}
        reasoning = head
    text = text.split(EOS, 1)[0]
    content, sep, block = text.partition(f"\n\n<{DSML}tool_calls>")
    calls = []
    if sep:
        for inv in block.split(f"<{DSML}invoke name=\"")[1:]:
            name, _, body = inv.partition('">')
            args = {}
            for par in body.split(f"<{DSML}parameter name=\"")[1:]:
                key, _, rest = par.partition('" string="')
                flag, _, rest = rest.partition('">')
                val = rest.split(f"</{DSML}parameter>", 1)[0]
                try:
                    args[key] = val if flag == "true" else json.loads(val)
                except json.JSONDecodeError:
                    args[key] = val
            calls.append({"type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    return {"content": content, "reasoning_content": reasoning, "tool_calls": calls}
