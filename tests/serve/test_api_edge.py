"""The API edge's pieces without a server: stop matching, the incremental decoder, the tool-call
parser on the model's DSML format (whole and streamed), chat templates, request checks."""

import pytest

from v4stack.chat import DSML, encode_chat
from v4stack.serve import tool_calls as tc
from v4stack.serve.chat_template import ChatTemplate
from v4stack.serve.limits import EdgeError, parse_json
from v4stack.serve.stops import StopMatcher
from v4stack.tokenizer import ByteTokenizer


def test_stop_matcher_holds_prefixes_and_cuts_at_the_first_stop():
    m = StopMatcher(["abc", "xyz"])
    out = [m.push(c) for c in "12ab3xabc9"]
    assert "".join(out) == "12ab3x" and m.stopped == "abc"
    assert out[2:4] == ["", ""]  # "a", "ab" held while they may start "abc"
    m = StopMatcher(["abc"])
    assert m.push("xxab") == "xx" and m.flush() == "ab"  # the end: held text comes out


def test_stream_decoder_holds_only_incomplete_characters():
    d = ByteTokenizer().stream()
    assert [d.push([b]) for b in "中".encode()] == ["", "", "中"]
    assert d.push([0xFF]) == "\ufffd"  # known invalid at once
    assert d.push([0xE4]) == "" and d.pending() == "\ufffd" and d.flush() == "\ufffd"


def _calls_text():
    inv = (f'\n<{DSML}invoke name="f">\n<{DSML}parameter name="a" string="false">1</{DSML}parameter>\n</{DSML}invoke>'
           f'\n<{DSML}invoke name="g">\n<{DSML}parameter name="b" string="true">x')
    return "hi" + tc.BLOCK + inv


def test_tool_calls_whole_and_streamed_agree():
    content, calls = tc.parse(_calls_text())
    assert content == "hi" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("g", '{"b": "x"}')]
    s = tc.ToolStream()
    text, streamed = "", []
    for ch in _calls_text():
        t, c = s.push(ch)
        text += t
        streamed += c
        if c:
            assert c[0].name == "f"  # released as soon as its invoke closed, before the stream ended
    t, c = s.push("", final=True)
    text, streamed = text + t, streamed + c
    assert text == "hi" and [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    assert tc.parse("no calls here") == ("no calls here", [])


def test_chat_templates():
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatTemplate().render(msgs, None) == encode_chat(msgs)
    assert ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}").render(msgs, None, "P") == "<user>hiP"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        ChatTemplate("/no/such/template")
    with pytest.raises(ValueError, match="messages"):  # a tool result with no call before it
        ChatTemplate().render([{"role": "tool", "content": "x"}], None)
    with pytest.raises(ValueError):  # the sandbox refuses attribute games
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(msgs, None)


def test_body_checks():
    for body, param in ((b"[" * 40 + b"]" * 40, "body"), (b'{"a": "\\ud800"}', "a"), (b"\xff", "body"),
                        (b'{"a": NaN}', "body"), (b"[]", "body")):
        with pytest.raises(EdgeError) as e:
            parse_json(body, 32)
        assert e.value.status == 400 and e.value.param == param, body
    assert parse_json(b'{"a": [1, {"b": "\\u00e9"}]}', 32) == {"a": [1, {"b": "é"}]}
