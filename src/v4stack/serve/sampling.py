"""Token sampling for a whole engine step at once: ``sample(logits [B, V], rows)``.

Greedy, temperature, top-k, top-p, min-p, presence / frequency / repetition penalties,
logit_bias, min_tokens (stop and EOS ids masked until then), and the log-probabilities of the
chosen token plus the top-n alternatives.

Randomness is counter-based: the uniform behind a request's i-th output token is a hash of
(seed, i) and nothing else, so a draw never depends on the batch, on the order of rows, or on
how many tokens were sampled before in this process; a request resumed from i durable tokens
continues simply by knowing i. Every operation here works row by row (elementwise, per-row sort,
softmax and cumulative sum), so a row's result does not depend on the other rows either.

Reported log-probabilities are those of the model's distribution (``log_softmax`` of the raw
logits in float32), before temperature, penalties, bias and truncation, as vLLM reports them by
default.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (1/T would overflow to inf/NaN)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
_M64 = (1 << 64) - 1


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()  # matched at the API edge; the engine stops on token ids only
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # alternatives per output token (0: the chosen token's only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first

    def __post_init__(self):  # normal forms, also for params read back from JSON records
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    def validate(self) -> "SamplingParams":
        def bad(name, rule, value):
            raise ValueError(f"{name} must be {rule}, got {value!r}")

        if not self.temperature >= 0 or self.temperature == float("inf"):
            bad("temperature", ">= 0 and finite", self.temperature)
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]", self.top_p)
        if self.top_k < 0:
            bad("top_k", ">= 0", self.top_k)
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]", self.min_p)
        if self.max_tokens < 1:
            bad("max_tokens", ">= 1", self.max_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            bad("seed", f"in [{SEED_MIN}, {SEED_MAX}]", self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, "in [-2, 2]", getattr(self, name))
        if not 0 < self.repetition_penalty <= 10:
            bad("repetition_penalty", "in (0, 10]", self.repetition_penalty)
        if any(not -100 <= b <= 100 for b in self.logit_bias.values()):
            bad("logit_bias", "values in [-100, 100]", self.logit_bias)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                bad(name, "in [0, 20]", v)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def fresh_seed() -> int:
    return secrets.randbits(63)


def _mix(z: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints with good avalanche."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, i: int) -> float:
    """The uniform in [0, 1) behind draw ``i`` of stream ``seed`` (53 random bits)."""
    return (_mix(_mix(seed & _M64) ^ (i & _M64)) >> 11) * 2.0**-53


@dataclass
class Row:
    """One request's place in a sampling call."""

    params: SamplingParams
    seed: int
    index: int  # which output token this is (0 = the first)
    output: list[int] = field(default_factory=list)  # tokens sampled so far (penalties)
    prompt: list[int] = field(default_factory=list)  # repetition penalty also counts these
    no_stop_ids: tuple[int, ...] = ()  # masked while index < min_tokens


@dataclass
class Draw:
    token: int
    logprob: float  # under the model's distribution (raw logits)
    top: list[tuple[int, float]] | None = None  # (token, logprob), best first, when asked
    sampled_logprob: float = 0.0  # under the temperature-scaled distribution (1 when greedy), float64


def top_logprobs(logprobs: torch.Tensor, n: int) -> list[list[tuple[int, float]]]:
    """The ``n`` most likely tokens of each row of ``logprobs [R, V]``, ties by lower id."""
    if n == 0:
        return [[] for _ in range(logprobs.shape[0])]
    v, i = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    v, i = v[:, :n].tolist(), i[:, :n].tolist()
    return [list(zip(ii, vv)) for ii, vv in zip(i, v)]


def _penalise(x: torch.Tensor, rows: list[Row]) -> None:
    V = x.shape[1]
    for b, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if 0 <= t < V], dtype=torch.long, device=x.device)
            vals = torch.tensor([p.logit_bias[t] for t in p.logit_bias if 0 <= t < V], dtype=x.dtype, device=x.device)
            x[b].index_add_(0, ids, vals)
        if p.repetition_penalty != 1.0 and (r.output or r.prompt):
            seen = torch.tensor(sorted(set(r.prompt) | set(r.output)), dtype=torch.long, device=x.device)
            v = x[b, seen]
            x[b, seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output:
            counts = torch.bincount(torch.tensor(r.output, dtype=torch.long, device=x.device), minlength=V)[:V]
            x[b] -= p.frequency_penalty * counts.to(x.dtype) + p.presence_penalty * (counts > 0).to(x.dtype)
        if r.index < p.min_tokens and r.no_stop_ids:
            ids = [t for t in r.no_stop_ids if 0 <= t < V]
            x[b, ids] = float("-inf")


def sample(logits: torch.Tensor, rows: list[Row]) -> list[Draw]:
    """One token for each row of ``logits [B, V]`` (any device); one call per engine step."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"sample: logits must be [len(rows), V], got {tuple(logits.shape)} for {len(rows)} rows")
    B, V = logits.shape
    raw = logits.detach().float()
    lp = torch.log_softmax(raw, dim=-1)
    x = raw.clone()
    _penalise(x, rows)
    dead = ~torch.isfinite(x).any(-1)  # everything masked or biased away: fall back to the model's
    if bool(dead.any()):
        x[dead] = raw[dead]
    greedy = [r.params.greedy for r in rows]
    tokens = [0] * B
    if any(greedy):
        g = [b for b in range(B) if greedy[b]]
        am = torch.argmax(x[g], dim=-1).tolist()
        for b, t in zip(g, am):
            tokens[b] = t
    s_rows = [b for b in range(B) if not greedy[b]]
    if s_rows:
        dev = x.device
        ps = [rows[b].params for b in s_rows]
        temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)[:, None]
        xs = x[s_rows] / temp
        sv, si = torch.sort(xs, dim=-1, descending=True, stable=True)
        pos = torch.arange(V, device=dev)[None, :]
        k = torch.tensor([min(p.top_k, V) if p.top_k else V for p in ps], device=dev)[:, None]
        sv = sv.masked_fill(pos >= k, float("-inf"))
        probs = torch.softmax(sv.double(), dim=-1)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float64, device=dev)[:, None]
        drop = (probs.cumsum(-1) - probs) >= top_p  # keep the smallest prefix reaching top_p
        min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float64, device=dev)[:, None]
        drop |= probs < min_p * probs[:, :1]
        drop[:, 0] = False  # the most likely token always stays
        probs = probs.masked_fill(drop, 0.0)
        cdf = probs.cumsum(-1)
        u = torch.tensor([uniform(rows[b].seed, rows[b].index) for b in s_rows], dtype=torch.float64,
                         device=dev)[:, None]
        j = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=V - 1)
        # a draw landing past the kept mass (rounding) takes the last kept token
        last = (~drop).sum(-1, keepdim=True) - 1
        j = torch.minimum(j, last)
        for b, t in zip(s_rows, si.gather(1, j)[:, 0].tolist()):
            tokens[b] = t
    tok_t = torch.tensor(tokens, device=lp.device)[:, None]
    chosen = lp.gather(1, tok_t)[:, 0].tolist()
    temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows], dtype=torch.float64,
                         device=raw.device)[:, None]
    scaled = raw.double() / temps  # the policy's log-probability, as importance ratios need it
    pol = (scaled.gather(1, tok_t) - torch.logsumexp(scaled, -1, keepdim=True))[:, 0].clamp(max=0.0).tolist()
    draws = [Draw(t, c, None, p) for t, c, p in zip(tokens, chosen, pol)]
    want = [b for b in range(B) if rows[b].params.logprobs]
    if want:
        n = max(rows[b].params.logprobs for b in want)
        tops = top_logprobs(lp[want], n)
        for b, t in zip(want, tops):
            draws[b].top = t[: rows[b].params.logprobs]
    for b in range(B):
        if rows[b].params.logprobs == 0:
            draws[b].top = []
    return draws


class Sampler:
    """One request's sampler for token-by-token callers (``generate``): draw ``i`` uses
    ``uniform(seed, i)``; ``advance(n)`` skips ``n`` draws."""

    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.seed = params.seed if params.seed is not None else fresh_seed()
        self.i = 0
        self.output: list[int] = []

    def advance(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"advance: n must be >= 0, got {n}")
        self.i += n

    def __call__(self, logits: torch.Tensor) -> int:
        """``logits [V]`` -> token id."""
        d = sample(logits[None], [Row(self.params, self.seed, self.i, self.output)])[0]
        self.i += 1
        self.output.append(d.token)
        return d.token
