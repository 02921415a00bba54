"""Request bodies of the OpenAI-compatible API, validated strictly at the edge.

Strict: no coercion (``"5"``, ``true`` or ``2.0`` are not a ``max_tokens``), no NaN or infinity,
and an unknown field is an error naming it, never silently ignored. A field the server cannot
honour (``suffix``, ``response_format`` other than text) is refused with a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from v4stack.serve.sampling import SEED_MAX, SEED_MIN, SamplingParams


class Unsupported(ValueError):
    """A well-formed field this server does not implement (answered with a 400 naming it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


Num = Union[StrictInt, StrictFloat]


class StreamOptions(_Strict):
    include_usage: Optional[StrictBool] = False
    continuous_usage_stats: Optional[StrictBool] = False


class ResponseFormat(_Strict):
    type: StrictStr
    json_schema: Optional[dict[str, Any]] = None


class _Sampling(_Strict):
    model: StrictStr
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[Num] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[Num] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[StrictInt] = Field(default=None, ge=-1)  # -1 or 0: off (vLLM's convention)
    min_p: Optional[Num] = Field(default=None, ge=0.0, le=1.0)
    seed: Optional[StrictInt] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: Optional[StrictBool] = False
    min_tokens: Optional[StrictInt] = Field(default=None, ge=0)
    presence_penalty: Optional[Num] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[Num] = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[Num] = Field(default=None, gt=0.0, le=10.0)
    logit_bias: Optional[dict[StrictStr, Num]] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[StrictInt] = Field(default=None, ge=1)
    user: Optional[StrictStr] = None  # accepted for clients' bookkeeping; it changes nothing
    response_format: Optional[ResponseFormat] = None
    return_token_ids: Optional[StrictBool] = None  # accepted: token ids are always returned

    def check(self, limits) -> None:
        """Checks that need the server's limits or span several fields."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > limits.max_stops:
            raise Unsupported("stop", f"stop: at most {limits.max_stops} stop strings, got {len(stops)}")
        for s in stops:
            if not s or len(s) > limits.max_stop_chars:
                raise Unsupported("stop", f"stop: each stop string must have 1..{limits.max_stop_chars} characters")
        ids = self.stop_token_ids or []
        if len(ids) > limits.max_stops:
            raise Unsupported("stop_token_ids", f"stop_token_ids: at most {limits.max_stops} ids, got {len(ids)}")
        if any(not 0 <= t < limits.vocab_size for t in ids):
            raise Unsupported("stop_token_ids", f"stop_token_ids: ids must lie in [0, {limits.vocab_size})")
        bias = self.logit_bias or {}
        if len(bias) > limits.vocab_size:
            raise Unsupported("logit_bias", f"logit_bias: at most {limits.vocab_size} entries")
        for k, v in bias.items():
            if not (k.isascii() and k.isdigit() and int(k) < limits.vocab_size) or not -100 <= v <= 100:
                raise Unsupported("logit_bias", f"logit_bias: keys must be token ids in [0, {limits.vocab_size}) "
                                                f"and values in [-100, 100]")
        if (self.n or 1) > limits.max_n:
            raise Unsupported("n", f"n: at most {limits.max_n}, got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise Unsupported("stream_options", "stream_options: only allowed with stream: true")
        if self.response_format is not None and self.response_format.type != "text":
            raise Unsupported("response_format", f"response_format: type {self.response_format.type!r} is not "
                                                 f"supported (this server has no guided decoding); use 'text'")

    def params(self, max_tokens: int, **extra) -> SamplingParams:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

        def f(v, default):
            return default if v is None else float(v)

        return SamplingParams(
            temperature=f(self.temperature, 1.0), top_p=f(self.top_p, 1.0), top_k=min(max(self.top_k or 0, 0), 1 << 31),
            min_p=f(self.min_p, 0.0), max_tokens=max_tokens, seed=self.seed, stop=stops,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=bool(self.ignore_eos),
            min_tokens=self.min_tokens or 0, presence_penalty=f(self.presence_penalty, 0.0),
            frequency_penalty=f(self.frequency_penalty, 0.0), repetition_penalty=f(self.repetition_penalty, 1.0),
            logit_bias={int(k): float(v) for k, v in (self.logit_bias or {}).items()}, **extra)


PromptT = Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    prompt: PromptT
    echo: Optional[StrictBool] = False
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=20)
    best_of: Optional[StrictInt] = Field(default=None, ge=1)
    suffix: Optional[StrictStr] = None

    def check(self, limits) -> None:
        super().check(limits)
        if self.suffix:
            raise Unsupported("suffix", "suffix: insertion (fill-in-the-middle) is not supported by this model")
        if self.best_of is not None:
            if self.best_of < (self.n or 1):
                raise Unsupported("best_of", f"best_of ({self.best_of}) must be >= n ({self.n or 1})")
            if self.best_of > limits.max_n:
                raise Unsupported("best_of", f"best_of: at most {limits.max_n}, got {self.best_of}")
            if self.stream and self.best_of > (self.n or 1):
                raise Unsupported("best_of", "best_of > n cannot be streamed")

    def prompts(self, encode) -> list[list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [encode(p)]
        if not p:
            return [[]]
        if isinstance(p[0], str):
            return [encode(s) for s in p]
        if isinstance(p[0], list):
            return [list(x) for x in p]
        return [list(p)]


class FunctionDef(_Strict):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Strict):
    name: StrictStr


class ToolChoiceNamed(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class ToolCallFunction(_Strict):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"]
    function: ToolCallFunction


class ContentPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[StrictStr, list[ContentPart], None] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[StrictStr] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ToolChoiceNamed]] = None
    parallel_tool_calls: Optional[StrictBool] = None

    def check(self, limits) -> None:
        super().check(limits)
        if self.top_logprobs is not None and not self.logprobs:
            raise Unsupported("top_logprobs", "top_logprobs: requires logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise Unsupported("max_completion_tokens", "max_completion_tokens and max_tokens disagree; send one")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise Unsupported("tool_choice", "tool_choice: requires tools")
        if isinstance(self.tool_choice, ToolChoiceNamed):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise Unsupported("tool_choice", f"tool_choice: no tool named {self.tool_choice.function.name!r}")
        if self.tools and len(self.tools) > limits.max_tools:
            raise Unsupported("tools", f"tools: at most {limits.max_tools}")
