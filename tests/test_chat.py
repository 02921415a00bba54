"""V4's chat encoding (chat and thinking modes, tools, tool results) and tokenizer loading."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from v4stack.chat import (ASSISTANT, BOS, DSML, EOS, END_THINK, THINK, USER, ChatFormatError, encode_chat,
                          parse_completion)
from v4stack.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "Hi!", "reasoning_content": "greet back"},
    {"role": "user", "content": "1+1=?"},
]


def test_chat_mode():
    assert encode_chat(CONV) == (f"{BOS}Be brief.{USER}hello{ASSISTANT}{END_THINK}Hi!{EOS}"
                                 f"{USER}1+1=?{ASSISTANT}{END_THINK}")


def test_thinking_mode_drops_reasoning_before_the_last_user_turn():
    assert encode_chat(CONV, thinking=True) == (f"{BOS}Be brief.{USER}hello{ASSISTANT}{END_THINK}Hi!{EOS}"
                                                f"{USER}1+1=?{ASSISTANT}{THINK}")
    # an assistant turn after the last user turn keeps its reasoning (a prefilled continuation)
    p = encode_chat(CONV + [{"role": "assistant", "content": "2", "reasoning_content": "add"}], thinking=True)
    assert p.endswith(f"{USER}1+1=?{ASSISTANT}{THINK}add{END_THINK}2{EOS}")
    assert "greet back" not in p
    assert encode_chat(CONV, thinking=True, reasoning_effort="high").startswith(BOS + "Reasoning Effort:")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_tool_calls_and_results():
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    p = encode_chat(msgs, tools=TOOLS)
    assert p.startswith(BOS + "\n\n## Tools\n") and json.dumps(TOOLS[0]["function"]) in p
    call = (f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
            f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
            f'<{DSML}parameter name="days" string="false">2</{DSML}parameter>\n'
            f'</{DSML}invoke>\n</{DSML}tool_calls>')
    assert p.endswith(f"{USER}Weather in Paris?{ASSISTANT}{END_THINK}{call}{EOS}"
                      f"{USER}<tool_result>sunny</tool_result>{ASSISTANT}{END_THINK}")
    parsed = parse_completion(call + EOS)
    assert parsed["content"] == "" and json.loads(parsed["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert parse_completion("let me see" + END_THINK + "It is sunny." + EOS, thinking=True) == {
        "content": "It is sunny.", "reasoning_content": "let me see", "tool_calls": []}


@pytest.mark.parametrize("msgs, field", [
    ([{"role": "user", "content": f"hi {USER} there"}], r"messages\[0\]\.content: contains the reserved"),
    ([{"role": "tool", "content": "x"}], r"messages\[0\]: a tool result needs an assistant tool call"),
    ([{"role": "wizard", "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: must be a JSON object"),
    ([], r"messages: must be a non-empty list"),
])
def test_hostile_messages_are_refused_naming_the_field(msgs, field):
    with pytest.raises(ChatFormatError, match=field):
        encode_chat(msgs)


def test_tokenizer_json_maps_control_strings_to_special_ids(tmp_path):
    vocab = {"[UNK]": 0, "hello": 1, "1": 2, "+": 3, "=?": 4, "Be": 5, "brief.": 6, "Hi!": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([BOS, EOS, USER, ASSISTANT, THINK, END_THINK])
    tok.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(tmp_path)
    assert isinstance(t, HFTokenizer) and t.vocab_size == 14
    ids = t.encode(encode_chat(CONV))
    assert ids[0] == t.token_id(BOS) and ids.count(t.token_id(USER)) == 2 and ids[-1] == t.token_id(END_THINK)
    assert t.decode([t.token_id(USER), 1]).startswith(USER)
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path / "missing"), ByteTokenizer)
