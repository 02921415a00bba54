"""The engine: one ``step()`` schedules, runs the model once over every scheduled request (the
model runner lays the step out as flat tensors; the model reads and writes the paged cache in
place), samples, and reports tokens. It is synchronous and single-threaded; the server drives it
from a background thread (``serve/runner.py``). A request stops on ``max_tokens``, on a token id
in its ``stop_token_ids`` (when its params have them) or on a stop string.

It runs the ops in ``invariant`` mode by default, so a request's tokens equal the model's own
incremental decode of that request alone, whatever else shares its steps.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from v4stack.model import V4Model
from v4stack.ops.mode import mode as ops_mode
from v4stack.serve.cache.manager import CacheManager, RequestCache
from v4stack.serve.graphs import DecodeGraphs
from v4stack.serve.model_runner import ModelRunner
from v4stack.serve.request import Request, Status
from v4stack.serve.overlap import InFlight, launch_ahead
from v4stack.serve.sampling import Draw, Row, Sampled, SamplingParams, sample_async, sample_greedy_async, top_logprobs
from v4stack.serve.scheduler import Scheduler
from v4stack.serve.spec_step import MTPStep


EXPERT_BACKENDS = ("local", "all_to_all", "megamoe")
INDEX_KEY_FORMATS = ("auto", "model", "fp8")


@dataclass
class EngineConfig:
    n_blocks: int = 256
    n_slots: int = 64
    n_snapshots: int | None = None  # boundary snapshots kept for prefix reuse (default: n_blocks)
    token_budget: int = 256
    max_running: int = 64
    ops_mode: str = "invariant"
    eos_token_id: int | None = None  # finishes a request unless it sets ignore_eos
    cuda_graphs: bool = True  # decode steps replay captured graphs (CUDA only)
    speculative: str | None = None  # "mtp": the MTP block drafts, the next step verifies (serve/spec_step.py)
    num_draft: int = 1  # draft tokens per request per step (one MTP block drafts one)
    # "all_to_all" / "megamoe": the routed experts run expert-parallel over the default process group
    # (under torchrun, one engine per rank, each holding its block of experts); every rank's engine
    # must run its steps together (the expert exchange is collective)
    expert_backend: str = "local"
    # decode steps overlap the host's work for the last step's tokens (serve/overlap.py); between
    # two ``step()`` calls the last launched step's tokens may then be unread (``drain()``)
    overlap: bool = False
    # how the paged cache stores the lightning indexer's keys: "auto", as V4 does (``ops/fp8_keys.py``:
    # 144 bytes a key at V4's width against 256 in bf16, exact) where the model runs V4's activation
    # rounding (``load_model`` turns it on for released checkpoints), else in the model dtype; "model":
    # always the model dtype; "fp8": always packed (without the rounding it rounds the keys)
    index_keys: str = "auto"

    def index_fp8(self, model) -> bool:
        return self.index_keys == "fp8" or (self.index_keys == "auto" and bool(getattr(model, "act_rounding", False)))

    def validate(self) -> "EngineConfig":
        for name in ("n_blocks", "n_slots", "token_budget", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine setting '{name}' must be >= 1, got {getattr(self, name)}")
        if self.ops_mode not in ("fast", "invariant"):
            raise ValueError(f"engine setting 'ops_mode' must be 'fast' or 'invariant', got {self.ops_mode!r}")
        if self.speculative not in (None, "mtp"):
            raise ValueError(f"engine setting 'speculative' must be None or 'mtp', got {self.speculative!r}")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise ValueError(f"engine setting 'expert_backend' must be one of {EXPERT_BACKENDS}, "
                             f"got {self.expert_backend!r}")
        if self.num_draft != 1:
            raise ValueError(f"engine setting 'num_draft' must be 1 (the MTP block drafts one token), got {self.num_draft}")
        if self.index_keys not in INDEX_KEY_FORMATS:
            raise ValueError(f"engine setting 'index_keys' must be one of {INDEX_KEY_FORMATS}, got {self.index_keys!r}")
        return self


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0
    tokens_generated: int = 0
    started: float = field(default_factory=time.perf_counter)
    ttft: list[float] = field(default_factory=list)
    finished: int = 0
    aborted: int = 0
    cache_bytes_written: int = 0  # bytes the model wrote into the cache pools, all steps
    last_step_cache_bytes: int = 0  # ... in the last step (O(new rows), never O(context))
    ahead: int = 0  # overlap: steps launched before the previous step's tokens were read
    wasted_rows: int = 0  # ... rows of those whose request had finished on the token in flight
    device_wait_s: float = 0.0  # host time spent waiting for sampled tokens (the rest of a step is host work)
    drafted: int = 0  # speculative: drafts verified
    accepted: int = 0  # ... and accepted
    # per finished request: (arrival, first token time, token times, prompt tokens, prefix-hit tokens)
    log: list = field(default_factory=list)


class Engine:
    def __init__(self, model: V4Model, config: EngineConfig | None = None):
        self.model = model.eval()
        self.model.pack_projections()  # each layer's projections of x as one GEMM (model/packed.py)
        self.config = (config or EngineConfig()).validate()
        c = self.config
        self.cache = CacheManager(model.cfg, model.dtype, c.n_blocks, c.n_slots, c.n_snapshots,
                                  device=model.embed.weight.device, index_fp8=c.index_fp8(model))
        self.spec = MTPStep(self) if c.speculative == "mtp" else None
        self.scheduler = Scheduler(self.cache, c.token_budget, c.max_running,
                                   draft_tokens=self.spec.draft_tokens if self.spec is not None else None)
        self.runner = ModelRunner(self.model, self.cache)
        if c.expert_backend != "local":
            self._expert_parallel(c)
        cuda = self.runner.device.type == "cuda"
        if c.expert_backend == "local" and (c.overlap or (c.cuda_graphs and cuda)):
            # without capture (CPU, or graphs off) the static decode layout runs eagerly
            self.runner.graphs = DecodeGraphs(self.model, self.cache, max_rows=c.max_running,
                                              capture=c.cuda_graphs and cuda)
        self._inflight: InFlight | None = None  # overlap: the decode step whose tokens are unread
        self._carry: list[Request] = []  # requests finished outside step() (drain), reported by the next
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()

    def _expert_parallel(self, c: EngineConfig) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError(f"engine setting 'expert_backend' is {c.expert_backend!r}: expert parallelism needs "
                             "torch.distributed initialised (run under torchrun)")
        from v4stack.megamoe.backend import expert_parallel_factory

        rows = c.token_budget + c.max_running * (1 + c.num_draft)  # a step's tokens, with headroom for drafts
        self.model.set_expert_backend(expert_parallel_factory(c.expert_backend, max_tokens=rows,
                                                              device=self.runner.device))

    @property
    def max_context(self) -> int:
        return min(self.model.cfg.max_position_embeddings, self.cache.blocks.n_blocks * self.cache.B - 1)

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Every check a new request must pass; reads only the config (safe from any thread)."""
        params.validate()
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model.cfg.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_context:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"the context this engine can hold ({self.max_context} tokens)")

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    on_event=None) -> Request:
        self.validate(prompt, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, list(prompt), params, on_event=on_event)
        eos = self.config.eos_token_id
        req.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset((eos,)) if eos is not None and not params.ignore_eos else frozenset())
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return False
        self._finish(req, "abort")
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def drain(self) -> None:
        """Read the in-flight step's tokens now (overlap), so no sampled token is left unread (each
        cache then holds its request's tokens and the next token is still to be fed); the requests
        it finishes are reported by the next ``step()``."""
        if self._inflight is not None:
            inf, self._inflight = self._inflight, None
            self._carry += self._collect(inf)

    def _finish(self, req: Request, reason: str) -> None:
        hit = req.cache.hit_tokens if req.cache is not None else 0
        self.scheduler.release(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        self.requests.pop(req.id, None)
        if reason == "abort":
            self.stats.aborted += 1
        else:
            self.stats.finished += 1
            self.stats.log.append((req.arrival, req.first_token_at, list(req.token_times), len(req.prompt), hit))
            if len(self.stats.log) > 100_000:
                del self.stats.log[:50_000]
        if req.on_event is not None:
            req.on_event(req, [], True)

    def detach(self, req: Request) -> Request:
        """Take a live request out of the engine without finishing it (its cache is released; no
        event is sent). Re-add it with ``add_request`` and, if its cache was restored elsewhere,
        ``attach``."""
        self.drain()
        self.scheduler.release(req)
        self.requests.pop(req.id, None)
        req.status = Status.WAITING
        return req

    def attach(self, req: Request, cache: RequestCache) -> None:
        """Run a waiting request (added with ``add_request``) on an already restored cache."""
        if self.requests.get(req.id) is not req or req.status is not Status.WAITING:
            raise ValueError(f"request {req.id!r} is not waiting in this engine")
        self.scheduler.attach(req, cache)

    @staticmethod
    def _tokens(req: Request, a: int, b: int) -> list[int]:
        """``req.all_tokens[a:b]`` without building the whole list."""
        p = len(req.prompt)
        return req.prompt[a:min(b, p)] + req.output[max(0, a - p) : max(0, b - p)]

    @torch.no_grad()
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it (with ``overlap``: whose last
        token was read in it)."""
        if self.spec is not None:
            return self.spec.step()
        done, self._carry = self._carry, []
        if self._inflight is not None:
            inf, self._inflight = self._inflight, None  # (an error below leaves nothing half-read in flight)
            self._inflight = ahead = launch_ahead(self, inf)  # launched before the host reads ``inf``
            done += self._collect(inf)
            if ahead is not None:
                return done
        return done + self._step()

    def _step(self) -> list[Request]:
        plan = self.scheduler.schedule()
        if not plan:
            return []
        now = time.perf_counter()
        for req, _ in plan:
            if req.scheduled_at is None:
                req.scheduled_at, req.cached_tokens = now, req.cache.hit_tokens
        starts = [req.computed for req, _ in plan]
        chunks = [(req.cache, self._tokens(req, req.computed, req.computed + n)) for req, n in plan]
        # prompt logprobs (echo) need the logits of every fed prompt row
        scoring = any(req.prompt_draws is not None and s < len(req.prompt) - 1 for (req, _), s in zip(plan, starts))
        # every row samples greedily with nothing read on the host: a graphed step draws them itself
        draw = not scoring and all(req.plain and n == req.pending for req, n in plan)
        with ops_mode(self.config.ops_mode):
            logits = self.runner.run(chunks, all_rows=scoring, draw=draw)
        if isinstance(logits, Sampled):  # drawn inside the step's graph
            self.stats.steps += 1
            self.stats.last_step_cache_bytes = self.runner.last_bytes
            self.stats.cache_bytes_written += self.runner.last_bytes
            self.stats.tokens_computed += sum(n for _, n in plan)
            inf = InFlight([req for req, _ in plan], [req.cache for req, _ in plan], logits)
            if self.config.overlap:
                self._inflight = inf
                return []
            return self._collect(inf)
        if scoring:
            ends = list(itertools.accumulate(n for _, n in plan))
            for (req, n), s, e in zip(plan, starts, ends):
                if req.prompt_draws is not None:
                    self._prompt_logprobs(req, s, n, logits[e - n : e])
            logits = logits[[e - 1 for e in ends]]
        self.stats.steps += 1
        self.stats.last_step_cache_bytes = self.runner.last_bytes
        self.stats.cache_bytes_written += self.runner.last_bytes
        ready, at = [], []  # row numbers, not per-row views of the logits (a view costs host time)
        for i, (req, n) in enumerate(plan):
            self.stats.tokens_computed += n
            if not req.pending:
                ready.append(req)
                at.append(i)
        if not ready:
            return []
        batch = logits if len(at) == logits.shape[0] else logits[at]
        with ops_mode(self.config.ops_mode):  # one call for the whole step
            if all(r.plain for r in ready):
                sampled = sample_greedy_async(batch)
            else:
                rows = [Row(r.params, r.params.seed, len(r.output), r.output, r.prompt, tuple(r.stop_ids))
                        for r in ready]
                sampled = sample_async(batch, rows)
        inf = InFlight(ready, [r.cache for r in ready], sampled)
        if self.config.overlap and self.runner.graphed and not scoring:
            self._inflight = inf  # read by the next step(), after it launched its own step
            return []
        return self._collect(inf)

    def _collect(self, inf: InFlight) -> list[Request]:
        """Read a step's sampled tokens and do the host work for them (once per step for every
        request: kept to plain Python on local names)."""
        vals, tops = inf.sampled.columns()  # (no ``Draw`` object a row: the columns go to each DrawLog)
        self.stats.device_wait_s += inf.sampled.wait_s
        done = []
        now = time.perf_counter()
        st = self.stats
        running = Status.RUNNING
        cache = self.cache
        B = cache.B
        for i, (req, rc, (t, lp, sp)) in enumerate(zip(inf.reqs, inf.caches, vals)):
            if req.status is not running or req.cache is not rc:
                st.wasted_rows += 1  # finished (or taken out) while this step was in flight
                continue
            tok = int(t)
            out = req.output
            p = len(req.prompt) + len(out)
            if rc.pos > p:  # overlap: the step after this one already fed the token as a placeholder
                rc.tokens[p] = tok
                if len(rc.hashes) < (p + 1) // B:  # it closed a block: publish it now its ids are known
                    cache.publish(rc)
            out.append(tok)
            req.draws.add(tok, lp, sp, None if tops is None else tops[i])
            req.token_times.append(now)
            st.tokens_generated += 1
            if req.first_token_at is None:
                req.first_token_at = now
                st.ttft.append(now - req.arrival)
                if len(st.ttft) > 100_000:
                    del st.ttft[:50_000]
            if req._stops is None:  # ``hit_stop`` without stop strings
                stopped = tok in req.stop_ids and len(out) >= req.params.min_tokens
            else:
                stopped = req.hit_stop()
            if stopped:
                req.stop_reason = tok
            if req.on_event is not None:
                req.on_event(req, [tok], False)
            if stopped or len(out) >= req.params.max_tokens:
                self._finish(req, "stop" if stopped else "length")
                done.append(req)
        return done

    @staticmethod
    def _prompt_logprobs(req: Request, start: int, n: int, lg: torch.Tensor) -> None:
        """Logits row r of a chunk starting at ``start`` scores prompt token start + r + 1."""
        lo, hi = max(start, 0), min(start + n, len(req.prompt) - 1)
        if hi <= lo:
            return
        lp = torch.log_softmax(lg[lo - start : hi - start].float(), dim=-1)
        nxt = torch.tensor(req.prompt[lo + 1 : hi + 1], device=lp.device)
        chosen = lp.gather(1, nxt[:, None])[:, 0].tolist()
        tops = top_logprobs(lp, req.params.prompt_logprobs)
        for k, (c, t) in enumerate(zip(chosen, tops)):
            req.prompt_draws[lo + 1 + k] = Draw(req.prompt[lo + 1 + k], c, t)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Request]:
        """Run ``prompts`` to completion (offline batch use and tests)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work():
            self.step()
        return reqs
