"""`v4stack check invariance`: are a request's logits the same alone and inside any batch?

Random prompts (mixed lengths, each prefilled in its own random chunks, then decoded token by
token on fixed random tokens) run first one request at a time through the model's reference
incremental path (``V4Model.step``), then through the serving path (the model runner's flat steps
over the paged cache, ``V4Model.step_paged``) at several batch sizes
in shuffled orders: a request joins as soon as a slot frees up, so some prefill while others
decode, and the row order is reshuffled every step. Each request's logits from every step are
compared bitwise with its solo run. The first batched schedule is also run twice (determinism),
and every request is fed once more in a single step (as recovery re-prefills a request), whose
rows must equal the chunked run's.

This module imports torch lazily so the CLI stays light.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import typer

DTYPES = ("float32", "bfloat16", "float64")


@dataclass
class Request:
    rid: int
    chunks: list  # token tensors, fed one per step: prefill chunks then single decode tokens


def make_requests(n: int, seed: int, vocab: int, max_prompt: int = 24, decode: int = 4) -> list[Request]:
    """``n`` requests of prompt length 1..max_prompt, random prefill chunking, ``decode`` tokens."""
    import torch

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for rid in range(n):
        L = rng.randint(1, max_prompt)
        toks = torch.randint(0, vocab, (L + decode,), generator=g)
        cuts, p = [], 0
        while p < L:
            step = rng.randint(1, max(1, L // 2))
            cuts.append((p, min(L, p + step)))
            p += step
        cuts += [(L + j, L + j + 1) for j in range(decode)]
        reqs.append(Request(rid, [toks[a:b] for a, b in cuts]))
    return reqs


def run_alone(model, reqs: list[Request]) -> dict[int, list]:
    out = {}
    for r in reqs:
        st = model.new_state()
        out[r.rid] = [model.step([(c, st)])[0].clone() for c in r.chunks]
    return out


class Serving:
    """The serving path for the check: a cache manager and the model runner; ``step`` feeds
    (chunk, request cache) pairs in one flat step and returns every fed row's logits per pair."""

    def __init__(self, model, reqs: list[Request], slots: int):
        from v4stack.serve.cache import CacheManager
        from v4stack.serve.engine import EngineConfig
        from v4stack.serve.model_runner import ModelRunner

        longest = max(sum(len(c) for c in r.chunks) for r in reqs)
        per = -(-(longest + 1) // model.cfg.block_tokens)
        self.cm = CacheManager(model.cfg, model.dtype, n_blocks=slots * per, n_slots=slots, n_snapshots=0,
                               device=model.embed.weight.device,  # the engine's default cache format
                               index_fp8=EngineConfig().index_fp8(model))
        self.runner = ModelRunner(model, self.cm)

    def new(self, r: Request):
        return self.cm.admit([int(t) for c in r.chunks for t in c.tolist()])

    def step(self, items: list) -> list:
        chunks = []
        for chunk, rc in items:
            if not self.cm.reserve(rc, len(chunk)):
                raise RuntimeError("check: cache too small")
            chunks.append((rc, chunk.tolist()))
        out, res, r = self.runner.run(chunks, all_rows=True), [], 0
        for chunk, _ in items:
            res.append(out[r : r + len(chunk)])
            r += len(chunk)
        return res

    def free(self, rc) -> None:
        self.cm.free(rc)


def run_batched(model, reqs: list[Request], batch: int, seed: int) -> dict[int, list]:
    """Continuous batching on the serving path: up to ``batch`` requests per step, joining as
    slots free up."""
    rng = random.Random(seed)
    queue = list(reqs)
    rng.shuffle(queue)
    out = {r.rid: [] for r in reqs}
    srv = Serving(model, reqs, batch)
    active: list[tuple[Request, object]] = []
    while queue or active:
        while queue and len(active) < batch:
            r = queue.pop(0)
            active.append((r, srv.new(r)))
        rng.shuffle(active)
        res = srv.step([(r.chunks[len(out[r.rid])], rc) for r, rc in active])
        for (r, _), logits in zip(active, res):
            out[r.rid].append(logits.clone())
        for r, rc in active:
            if len(out[r.rid]) == len(r.chunks):
                srv.free(rc)
        active = [(r, rc) for r, rc in active if len(out[r.rid]) < len(r.chunks)]
    return out


def run_one_chunk(model, reqs: list[Request]) -> dict[int, "torch.Tensor"]:
    """Each request alone on the serving path, all its tokens in one step (what recovery does
    when it re-prefills)."""
    import torch

    out = {}
    srv = Serving(model, reqs, 1)
    for r in reqs:
        rc = srv.new(r)
        out[r.rid] = srv.step([(torch.cat(r.chunks), rc)])[0].clone()
        srv.free(rc)
    return out


def compare_rows(ref: dict[int, list], whole: dict) -> dict:
    """Rows of the chunked solo run vs the one-chunk run, bitwise."""
    import torch

    rows = differ = 0
    reqs_differ = set()
    for rid, steps in ref.items():
        a, b = torch.cat(steps), whole[rid]
        rows += a.shape[0]
        bad = ~(_bits(a).view(a.shape[0], -1) == _bits(b).view(b.shape[0], -1)).all(-1)
        if bad.any():
            differ += int(bad.sum())
            reqs_differ.add(rid)
    return {"rows": rows, "rows_differ": differ, "requests_differ": len(reqs_differ)}


def _bits(t):
    import torch

    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def compare(ref: dict[int, list], got: dict[int, list]) -> dict:
    """Bitwise comparison of every (request, step) logits tensor."""
    steps = differ = rows_differ = 0
    reqs_differ = set()
    max_abs = 0.0
    for rid, ref_steps in ref.items():
        for a, b in zip(ref_steps, got[rid], strict=True):
            steps += 1
            if a.shape == b.shape and a.dtype == b.dtype and bool((_bits(a) == _bits(b)).all()):
                continue
            differ += 1
            reqs_differ.add(rid)
            d = (a.double() - b.double()).abs()
            rows_differ += int((d.amax(-1) > 0).sum()) if d.numel() else 0
            max_abs = max(max_abs, float(d.max()) if d.numel() else 0.0)
    return {"steps": steps, "steps_differ": differ, "rows_differ": rows_differ,
            "requests_differ": len(reqs_differ), "max_abs_diff": max_abs}


def build_model(preset: str = "tiny", dtype: str = "float32", device: str = "cpu", seed: int = 0,
                overrides: dict | None = None, act_rounding: bool = False):
    """The check's model: random weights from ``seed``. On a GPU the model is built there and its
    weights drawn by the device's generator (the CPU's float64 draws of a V4-Flash-wide model take
    tens of seconds, its copy to the GPU more). ``overrides``: config fields replacing the
    preset's (e.g. fewer layers at Flash widths). ``act_rounding``: V4's activation rounding on, as
    a released checkpoint loads (the serving path then keeps its indexer keys packed)."""
    import torch

    from v4stack.config import ModelConfig
    from v4stack.config import preset as get_preset
    from v4stack.model import V4Model
    from v4stack.model.init import init_weights

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    cfg = get_preset(preset)
    if overrides:
        cfg = ModelConfig.from_dict({**cfg.to_dict(), **overrides})
    if torch.device(device).type == "cpu":
        model = V4Model(cfg, seed=seed)
    else:
        with torch.device(device):
            model = V4Model(cfg, seed=None)
        init_weights(model, seed, device=device)
    model = model.cast(getattr(torch, dtype)).eval()
    if act_rounding:
        from v4stack.model.quant import set_act_rounding

        set_act_rounding(model, True)
    return model


def check_invariance(preset: str = "tiny", prompts: int = 32, mode: str = "invariant", seed: int = 0,
                     batch_sizes: tuple[int, ...] = (3, 8, 32), dtype: str = "float32",
                     max_prompt: int = 24, decode: int = 4, device: str = "cpu", overrides: dict | None = None,
                     model=None, act_rounding: bool = False) -> dict:
    """Run ``prompts`` requests alone and batched under ops mode ``mode``; compare bitwise.
    ``overrides``: config fields replacing the preset's (e.g. fewer layers at Flash widths);
    ``model``: one built by ``build_model`` (so several modes share one build; ``preset``,
    ``dtype``, ``device`` and ``overrides`` are then the model's). ``seconds`` in the result: wall
    time of each phase."""
    import time

    import torch

    from v4stack import ops

    if mode not in ops.MODES:
        raise ValueError(f"mode must be one of {list(ops.MODES)}, got {mode!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if prompts < 1:
        raise ValueError(f"prompts must be >= 1, got {prompts}")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be non-empty and >= 1, got {list(batch_sizes)}")
    t0 = time.perf_counter()
    secs = {}
    if model is None:
        model = build_model(preset, dtype, device, seed, overrides, act_rounding)
        secs["build"] = time.perf_counter() - t0
    device, dtype = model.embed.weight.device, str(model.dtype).replace("torch.", "")
    reqs = make_requests(prompts, seed, model.cfg.vocab_size, max_prompt, decode)
    for r in reqs:
        r.chunks = [c.to(device) for c in r.chunks]
    runs = []

    def lap(name: str) -> None:
        nonlocal t0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        secs[name] = round(secs.get(name, 0.0) + time.perf_counter() - t0, 2)
        t0 = time.perf_counter()

    with torch.no_grad(), ops.mode(mode):
        lap("setup")
        ref = run_alone(model, reqs)
        lap("alone")
        first = None
        for i, b in enumerate(batch_sizes):
            got = run_batched(model, reqs, b, seed=seed * 1000 + i)
            first = first or (b, seed * 1000 + i, got)
            runs.append({"batch_size": b, "order_seed": seed * 1000 + i, **compare(ref, got)})
        lap("batched")
        b, s, got = first
        again = compare(got, run_batched(model, reqs, b, seed=s))
        lap("again")
        rechunk = compare_rows(ref, run_one_chunk(model, reqs))
        lap("one_chunk")
    total = {k: sum(r[k] for r in runs) for k in ("steps", "steps_differ", "rows_differ")}
    return {
        "preset": preset, "mode": mode, "dtype": dtype, "prompts": prompts, "seed": seed,
        "act_rounding": bool(getattr(model, "act_rounding", False)),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "seconds": secs,
        "steps_per_request": [len(r.chunks) for r in reqs],
        "runs": runs,
        "steps_compared": total["steps"], "steps_differ": total["steps_differ"],
        "rows_differ": total["rows_differ"],
        "requests_differ": max((r["requests_differ"] for r in runs), default=0),
        "max_abs_diff": max((r["max_abs_diff"] for r in runs), default=0.0),
        "deterministic": again["steps_differ"] == 0,
        "invariant": total["steps_differ"] == 0,
        "one_chunk": rechunk,
        "chunking_invariant": rechunk["rows_differ"] == 0,
    }


# ---- CLI -----------------------------------------------------------------------------------

app = typer.Typer(help="Checks a user can run against the local install.", no_args_is_help=True)


@app.callback()
def _checks() -> None:
    """Checks a user can run against the local install."""


@app.command("invariance")
def invariance_command(
    preset: str = typer.Option("tiny", help="Model preset (random weights)."),
    prompts: int = typer.Option(32, min=1, help="Number of random prompts."),
    mode: str = typer.Option("invariant", help="ops mode: invariant or fast."),
    seed: int = typer.Option(0, help="Seed for weights, prompts and batch orders."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float64."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print the full JSON report."),
    act_rounding: bool = typer.Option(False, "--act-rounding",
                                      help="V4's activation rounding on, as a released checkpoint runs (rounded KV, "
                                           "packed indexer keys in the serving cache)."),
):
    """Run prompts alone and in shuffled batches; compare logits bitwise at every step.

    Also feeds each request in one step and compares its rows with the chunked run. Exits 1 in
    invariant mode if any step differs, a repeat is not bit-identical, or chunking changes a row.
    """
    try:
        rep = check_invariance(preset, prompts, mode, seed=seed, dtype=dtype, device=device, act_rounding=act_rounding)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if as_json:
        typer.echo(json.dumps(rep, indent=2))
    else:
        typer.echo(f"mode {rep['mode']}  preset {rep['preset']}  dtype {rep['dtype']}  prompts {rep['prompts']}")
        for r in rep["runs"]:
            typer.echo(f"  batch {r['batch_size']:>3}: {r['steps_differ']}/{r['steps']} steps differ "
                       f"({r['requests_differ']} requests, max |diff| {r['max_abs_diff']:.3g})")
        typer.echo(f"  same batch twice bit-identical: {rep['deterministic']}")
        oc = rep["one_chunk"]
        typer.echo(f"  whole request in one step vs its chunks: {oc['rows_differ']}/{oc['rows']} rows differ")
        typer.echo("invariant" if rep["invariant"] else f"NOT invariant: {rep['steps_differ']} steps differ")
    if mode == "invariant" and not (rep["invariant"] and rep["deterministic"] and rep["chunking_invariant"]):
        raise typer.Exit(1)
