"""Tokenizers: the byte-level default (token id = UTF-8 byte value, any vocab >= 256) and a
``tokenizer.json`` loaded with the ``tokenizers`` library (``load_tokenizer``)."""

from __future__ import annotations

import codecs
import os
from pathlib import Path


class ByteTokenizer:
    vocab_size = 256
    eos_token_id: int | None = None  # bytes have no end-of-text token

    def encode(self, text: str) -> list[int]:
        """``text`` must be encodable (no lone surrogates): the API edge refuses those first."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_str(self, i: int) -> str:
        """One token as text for logprobs: the character for ASCII, ``<0xNN>`` for a byte that is only
        part of a character (so distinct bytes stay distinct keys)."""
        return chr(i) if 0 <= i < 128 else f"<0x{i:02X}>" if 0 <= i < 256 else f"<id:{i}>"

    def token_bytes(self, i: int) -> list[int]:
        return [i] if 0 <= i < 256 else []

    def stream(self) -> "StreamDecoder":
        return StreamDecoder()


class StreamDecoder:
    """Incremental UTF-8: text appears as soon as its bytes are complete; only the bytes of a
    character still arriving are held, and a byte already known invalid becomes U+FFFD at once."""

    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: list[int]) -> str:
        return self._dec.decode(bytes(i for i in ids if 0 <= i < 256))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)

    def pending(self) -> str:
        """The bytes still held, as a final decode would show them (U+FFFD each), without flushing."""
        return self._dec.getstate()[0].decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` (the released checkpoints' tokenizer) through the ``tokenizers``
    library; the chat format's control strings map to their special ids."""

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {p}")
        self._tok = Tokenizer.from_file(str(p))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def load_tokenizer(path: str | os.PathLike | None = None):
    """The tokenizer of a model directory (its ``tokenizer.json``), or the byte tokenizer when
    ``path`` is None or holds no ``tokenizer.json`` (the tiny preset's default)."""
    if path is not None and ((Path(path) / "tokenizer.json").is_file() or Path(path).is_file()):
        return HFTokenizer(path)
    return ByteTokenizer()
