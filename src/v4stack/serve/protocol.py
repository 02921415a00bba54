"""Request bodies of the OpenAI-compatible API, validated at the edge (pydantic)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from v4stack.serve.sampling import SamplingParams


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[int] = Field(default=16, ge=1)
    temperature: Optional[float] = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=0, ge=0)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    n: Optional[int] = Field(default=1, ge=1, le=1)

    def sampling(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            max_tokens=16 if self.max_tokens is None else self.max_tokens,
            seed=self.seed,
            stop=tuple(s for s in stop if s),
        )


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if isinstance(p, dict))
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)

    def prompt_text(self) -> str:
        """The byte-level chat template: one ``<|role|>`` line per message, then the assistant tag."""
        parts = [f"<|{m.role}|>{m.text()}\n" for m in self.messages]
        return "".join(parts) + "<|assistant|>"
