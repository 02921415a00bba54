"""OpenAI response shapes: logprobs (completions and chat), choices, stream chunks."""

from __future__ import annotations

from v4stack.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def completion_logprobs(ids: list[int], draws: list, offset0: int = 0, prompt_draws=None,
                        prompt_ids: list[int] | None = None) -> dict:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; with ``prompt_draws``
    (echo) the prompt's tokens come first, the very first one scored ``null``."""
    all_ids, entries = [], []
    if prompt_draws is not None:
        for t, d in zip(prompt_ids, prompt_draws):
            all_ids.append(t)
            entries.append(d)
    all_ids += ids
    entries += draws
    dec, pos = TOK.stream(), offset0
    tokens, lps, tops, offsets = [], [], [], []
    for t, d in zip(all_ids, entries):
        offsets.append(pos)
        pos += len(dec.push([t]))
        tokens.append(TOK.token_str(t))
        lps.append(None if d is None else d.logprob)
        tops.append(None if d is None or d.top is None else {TOK.token_str(i): lp for i, lp in d.top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(ids: list[int], draws: list) -> dict:
    def one(t, lp):
        return {"token": TOK.token_str(t), "logprob": lp, "bytes": TOK.token_bytes(t)}

    return {"content": [{**one(t, d.logprob), "top_logprobs": [one(i, lp) for i, lp in (d.top or [])]}
                        for t, d in zip(ids, draws)]}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
