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
from array import array
import time
from dataclasses import dataclass, field

import torch

from v4stack.ops import fused

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

    @property
    def plain(self) -> bool:
        """Greedy with nothing that reads the host's token lists (no penalties, bias or
        ``min_tokens``) and no log-probability report: a row ``sample_greedy_async`` serves."""
        return bool(self.temperature < GREEDY_BELOW and self.logprobs is None and not self.logit_bias
                    and self.repetition_penalty == 1.0 and not self.presence_penalty
                    and not self.frequency_penalty and self.min_tokens == 0)


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


@dataclass(slots=True)
class Draw:
    token: int
    logprob: float  # under the model's distribution (raw logits)
    top: list[tuple[int, float]] | tuple | None = None  # (token, logprob), best first, when asked (``()``: zero)
    sampled_logprob: float = 0.0  # under the temperature-scaled distribution (1 when greedy), float64


class DrawLog:
    """A request's ``Draw`` per output token, kept as columns: the ids and the two log-probabilities
    in typed arrays, the alternatives (when asked) by index. A list of ``Draw`` objects would be one
    object the cyclic collector tracks per token - at 256 requests, 256 more each step, and what a
    full collection walks (``serve/heap.py``); arrays hold no references, so a long generation
    adds nothing to it. Reads give ``Draw``s: ``log[i]``, ``log[a:b]`` (a list), iteration."""

    __slots__ = ("tokens", "logprobs", "sampled", "tops")

    def __init__(self, draws=()):
        self.tokens, self.logprobs, self.sampled = array("q"), array("d"), array("d")
        self.tops: dict[int, list | tuple] = {}
        self.extend(draws)

    def append(self, d: Draw) -> None:
        self.add(d.token, d.logprob, d.sampled_logprob, d.top)

    def add(self, token: int, logprob: float, sampled_logprob: float, top=None) -> None:
        """``append(Draw(token, logprob, top, sampled_logprob))`` without the ``Draw``."""
        if top is not None:
            self.tops[len(self.tokens)] = top
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.sampled.append(sampled_logprob)

    def extend(self, draws) -> None:
        for d in draws:
            self.append(d)

    def __iadd__(self, draws) -> "DrawLog":
        self.extend(draws)
        return self

    def __len__(self) -> int:
        return len(self.tokens)

    def _at(self, i: int) -> Draw:
        return Draw(self.tokens[i], self.logprobs[i], self.tops.get(i), self.sampled[i])

    def __getitem__(self, i):
        n = len(self.tokens)
        if isinstance(i, slice):
            return [self._at(k) for k in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("draw index out of range")
        return self._at(i)

    def __iter__(self):
        return (self._at(k) for k in range(len(self.tokens)))

    def __repr__(self) -> str:
        return f"DrawLog({len(self)} draws)"


def top_logprobs(logprobs: torch.Tensor, n: int) -> list[list[tuple[int, float]]]:
    """The ``n`` most likely tokens of each row of ``logprobs [R, V]``, ties by lower id."""
    if n == 0:
        return [[] for _ in range(logprobs.shape[0])]
    v, i = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    v, i = v[:, :n].tolist(), i[:, :n].tolist()
    return [list(zip(ii, vv)) for ii, vv in zip(i, v)]


def _touches(r: Row) -> bool:
    """Whether ``_penalise`` changes row ``r`` (without it the logits are used as they are)."""
    p = r.params
    return bool(p.logit_bias or (p.repetition_penalty != 1.0 and (r.output or r.prompt))
                or ((p.presence_penalty or p.frequency_penalty) and r.output)
                or (r.index < p.min_tokens and r.no_stop_ids))


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


def _row_params(rows: list[Row], greedy: list[bool], dev) -> torch.Tensor:
    """Every per-row number the device path needs, in one float64 ``[B, 6]`` tensor moved in one
    transfer: temperature (1 for greedy rows), top-k (V when off: 0 here), top-p, min-p, the row's
    uniform and the policy temperature."""
    vals = []
    for r, g in zip(rows, greedy):
        p = r.params
        t = 1.0 if g else p.temperature
        vals.append((t, float(p.top_k), p.top_p, p.min_p, 0.0 if g else uniform(r.seed, r.index), t))
    return torch.tensor(vals, dtype=torch.float64).to(dev, non_blocking=True)


def _truncated_draw(x: torch.Tensor, prm: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p sampling of every row of ``x [R, V]`` with the row's
    counter-based uniform; row-local throughout, no host sync. Returns token ids ``[R]``."""
    R, V = x.shape
    dev = x.device
    xs = x / prm[:, 0:1].to(torch.float32)
    sv, si = torch.sort(xs, dim=-1, descending=True, stable=True)
    pos = torch.arange(V, device=dev)[None, :]
    k = prm[:, 1:2].to(torch.long)
    k = torch.where((k == 0) | (k > V), V, k)
    sv = sv.masked_fill(pos >= k, float("-inf"))
    probs = torch.softmax(sv.double(), dim=-1)
    drop = (probs.cumsum(-1) - probs) >= prm[:, 2:3]  # keep the smallest prefix reaching top_p
    drop |= probs < prm[:, 3:4] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always stays
    probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(-1)
    j = torch.searchsorted(cdf, prm[:, 4:5] * cdf[:, -1:], right=True).clamp(max=V - 1)
    # a draw landing past the kept mass (rounding) takes the last kept token
    last = (~drop).sum(-1, keepdim=True) - 1
    return si.gather(1, torch.minimum(j, last))[:, 0]


def _policy_logprob(raw: torch.Tensor, tok: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """log softmax(raw / T)[tok] per row, clamped at 0. On the CPU in float64 (the trainer's
    importance ratios compare against float64 recomputations); on CUDA in float32 with a max-shifted
    logsumexp (``torch.logsumexp`` subtracts the row max), one pass over the vocabulary."""
    dt = torch.float64 if raw.device.type == "cpu" else torch.float32
    scaled = raw.to(dt) / temp.to(dt)
    return (scaled.gather(1, tok[:, None]) - torch.logsumexp(scaled, -1, keepdim=True))[:, 0].clamp(max=0.0)


def _model_logprobs(raw: torch.Tensor) -> torch.Tensor:
    """The model's log-probabilities (float32). On CUDA through ``ops.log_softmax`` (the dispatch
    table's pick for the active mode); on the CPU ``torch.log_softmax``, the bits the tests pin."""
    if raw.device.type == "cpu":
        return torch.log_softmax(raw, dim=-1)
    from v4stack import ops

    return ops.log_softmax(raw, -1)


class Sampled:
    """One step's draws, launched on the device and read back later: ``tokens`` (``[B]`` int64 on
    the logits' device) can feed the next step before the host has seen them; ``collect()``
    waits for the one read-back and returns the ``Draw`` of every row."""

    def __init__(self, tokens: torch.Tensor, host: torch.Tensor, done, lp: torch.Tensor | None,
                 rows: list[Row] | None, pinned: "_Pinned | None" = None, fed: bool = False):
        self.tokens, self._host, self._done, self._lp, self._rows = tokens, host, done, lp, rows
        self._pinned = pinned
        self.wait_s = 0.0  # how long ``collect`` waited for the device
        # drawn inside a decode step's static body: ``tokens`` are also rows 0.. of the graphs' fed
        # buffer, which the next step reads its ids from (``DecodeGraphs``)
        self.fed = fed

    @property
    def unread(self) -> bool:
        """The values still sit in the buffer the device writes them to (not yet ``settle``d)."""
        return self._done is not None

    def settle(self) -> None:
        """Wait for the read-back and keep its values, so the buffer it landed in may be reused."""
        if self._done is None:
            return
        t0 = time.perf_counter()
        self._done.synchronize()  # the step's one wait (only this step's work, not later launches)
        self.wait_s += time.perf_counter() - t0
        vals = self._host.tolist()
        if self._pinned is not None:  # read: the buffer may take the next step's tokens
            self._pinned.put(self._host, self._done)
            self._pinned = None
        self._host, self._done = vals, None

    def collect(self) -> list[Draw]:
        vals, top = self.columns()
        if top is None:
            return [Draw(int(t), c, None, p) for t, c, p in vals]
        return [Draw(int(t), c, k, p) for (t, c, p), k in zip(vals, top)]

    def columns(self) -> tuple[list, list | None]:
        """``collect`` without a ``Draw`` a row: each row's ``[id, logprob, sampled_logprob]`` (the
        id as a float) and its alternatives (None for all when the rows are plain ones) - what the
        engine's read-back appends to each request's ``DrawLog`` directly."""
        self.settle()
        vals = self._host if isinstance(self._host, list) else self._host.tolist()
        rows = self._rows
        if rows is None:  # plain rows: no log-probability report
            return vals, None
        asked = [r.params.logprobs for r in rows]
        top: list = [None if n is None else () for n in asked]  # () : asked for zero alternatives
        want = [b for b, n in enumerate(asked) if n]
        if want:
            tops = top_logprobs(self._lp[want], max(asked[b] for b in want))
            for b, t in zip(want, tops):
                top[b] = t[: asked[b]]
        return vals, top


class _Pinned:
    """Pinned host buffers for the read-back of sampled rows, reused once read: allocating pinned
    memory every step costs the host far more than the copy (and can wait on the device)."""

    def __init__(self):
        self.free: dict[tuple, list] = {}

    def take(self, shape: tuple, dtype: torch.dtype):
        got = self.free.get((shape, dtype))
        if got:
            return got.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=True), torch.cuda.Event()

    def put(self, host: torch.Tensor, done) -> None:
        pool = self.free.setdefault((tuple(host.shape), host.dtype), [])
        if len(pool) < 8:
            pool.append((host, done))


_PINNED = _Pinned()


def greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy draws of plain rows on the logits' device, nothing read back: the ids ``[B]``
    (int64) and ``[B, 3]`` float64 rows (id, its log-probability, the policy log-probability at
    temperature 1). On CUDA one kernel (``ops.fused.greedy_draw``); a CUDA graph can hold it."""
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [rows, V], got {tuple(logits.shape)}")
    if logits.device.type != "cuda":  # ``sample_async``'s greedy path, without per-row parameters
        raw = logits.detach().float()
        lp = _model_logprobs(raw)
        tok = torch.argmax(raw, dim=-1)
        one = torch.ones(raw.shape[0], 1, dtype=torch.float64)  # the policy temperature of a greedy row
        return tok, torch.stack([tok.double(), lp.gather(1, tok[:, None])[:, 0].double(),
                                 _policy_logprob(raw, tok, one).double()], 1)
    return fused.greedy_draw(logits.detach())


def sample_greedy_async(logits: torch.Tensor) -> Sampled:
    """``sample_async`` for rows that are all ``SamplingParams.plain``: the same draws, without a
    per-row description (``collect`` gives no alternatives, as such rows ask for none). On CUDA
    one kernel (ids and both log-probabilities) and one read-back into a reused pinned buffer."""
    tok, out = greedy_rows(logits)
    if logits.device.type != "cuda":
        return Sampled(tok, out, None, None, None)
    host, done = _PINNED.take(tuple(out.shape), out.dtype)
    host.copy_(out, non_blocking=True)
    done.record(torch.cuda.current_stream(logits.device))
    return Sampled(tok, host, done, None, None, _PINNED)


def sample_async(logits: torch.Tensor, rows: list[Row]) -> Sampled:
    """``sample`` without its wait: every kernel is launched and the read-back is queued behind
    them (non-blocking into pinned memory, an event marks it); nothing waits until ``collect``."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"sample: logits must be [len(rows), V], got {tuple(logits.shape)} for {len(rows)} rows")
    dev = logits.device
    greedy = [r.params.greedy for r in rows]
    if dev.type == "cuda" and all(greedy) and not any(r.params.logprobs or _touches(r) for r in rows):
        # the common decode step: the plain rows' one kernel and one read-back, these rows' report
        got = sample_greedy_async(logits)
        got._rows = rows
        return got
    raw = logits.detach().float()
    lp = _model_logprobs(raw)
    prm = _row_params(rows, greedy, dev)
    x = raw
    if any(_touches(r) for r in rows):
        x = raw.clone()
        _penalise(x, rows)
        dead = ~torch.isfinite(x).any(-1, keepdim=True)  # everything masked or biased away: the model's
        x = torch.where(dead, raw, x)
    if all(greedy):
        tok = torch.argmax(x, dim=-1)
    elif not any(greedy):
        tok = _truncated_draw(x, prm)
    else:
        tok = torch.where(torch.tensor(greedy).to(dev, non_blocking=True), torch.argmax(x, dim=-1),
                          _truncated_draw(x, prm))
    out = torch.stack([tok.double(), lp.gather(1, tok[:, None])[:, 0].double(),
                       _policy_logprob(raw, tok, prm[:, 5:6]).double()], 1)
    if dev.type == "cpu":
        return Sampled(tok, out, None, lp, rows)
    host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
    host.copy_(out, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(dev))
    return Sampled(tok, host, done, lp, rows)


def sample(logits: torch.Tensor, rows: list[Row]) -> list[Draw]:
    """One token for each row of ``logits [B, V]`` (any device); one call per engine step.

    On a device the whole step is sync-free until its end: per-row parameters go up in one
    transfer, and the tokens with both log-probabilities come back in one (``[B, 3]`` float64,
    non-blocking into pinned memory, then one wait); the top-n alternatives, when asked, in one more.
    """
    return sample_async(logits, rows).collect()


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
