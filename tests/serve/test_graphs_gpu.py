"""Decode through CUDA graphs on a GPU (tiny preset, bf16): the replayed steps give the eager
engine's tokens in both ops modes, also with overlapped steps (each launched with the previous
step's sampled ids as device inputs), in invariant mode a request's tokens do not depend on the
batch it decodes in, and a CSA layer's indexer on the side stream gives the one-stream tokens."""

import pytest
import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (21, 9, 30, 17, 40)]


@torch.no_grad()
@pytest.mark.parametrize("mode", ["fast", "invariant"])
def test_graph_replays_give_the_eager_tokens(mode):
    model = V4Model(preset("tiny"), seed=3).cast(torch.bfloat16).eval().cuda()
    sp = SamplingParams(max_tokens=24)
    out = {}
    for graphs, overlap in ((False, False), (True, False), (True, True)):
        eng = Engine(model, EngineConfig(n_blocks=64, n_slots=8, n_snapshots=0, ops_mode=mode, cuda_graphs=graphs,
                                         overlap=overlap))
        out[graphs, overlap] = [r.output for r in eng.generate(_prompts(), sp)]
        if graphs:
            assert eng.runner.graphs.error is None and eng.runner.graphs.replays >= 15
        if overlap:  # steps launched with the sampled ids as device inputs
            assert eng.stats.ahead >= 10
        if graphs:  # greedy rows: each graph drew its tokens and the next one read them on the device
            g = eng.runner.graphs
            assert g.draws >= 15 and g.settled == 0 and (g.fed_steps >= 10 or not overlap)
    assert out[True, False] == out[False, False] == out[True, True]
    if mode == "invariant":
        eng = Engine(model, EngineConfig(n_blocks=64, n_slots=8, n_snapshots=0, ops_mode=mode))
        alone = [eng.generate([p], sp)[0].output for p in _prompts()]
        assert alone == out[True, False]


@torch.no_grad()
def test_layout_copied_ahead_gives_the_eager_tokens():
    """``layout_ahead``: each step's layout copied into its graph's buffer on the side stream before
    the replay (overlapped steps) gives the eager engine's tokens. Control: the same steps with the
    copy left out replay stale layouts and give other tokens, so the comparison sees the copy."""
    from v4stack.serve.graphs import DecodeGraphs

    model = V4Model(preset("tiny"), seed=3).cast(torch.bfloat16).eval().cuda()
    sp = SamplingParams(max_tokens=24)

    def run(graphs: bool, ahead: bool = False, copy: bool = True):
        eng = Engine(model, EngineConfig(n_blocks=64, n_slots=8, n_snapshots=0, ops_mode="fast", cuda_graphs=graphs,
                                         overlap=graphs))
        if graphs:
            g = eng.runner.graphs
            g.layout_ahead = ahead
            if not copy:
                g._copy_ahead = lambda entry, dev: None
        out = [r.output for r in eng.generate(_prompts(), sp)]
        return out, eng

    want, _ = run(False)
    got, eng = run(True, ahead=True)
    g = eng.runner.graphs
    assert g.error is None and g.replays >= 15 and g.settled == 0 and g.draws >= 15 and g.fed_steps >= 10
    assert all(e.ahead for pair in g.graphs.values() for e in pair)
    assert got == want
    stale, _ = run(True, ahead=True, copy=False)
    assert stale != want


@torch.no_grad()
@pytest.mark.parametrize("mode", ["fast", "invariant"])
def test_indexer_on_the_side_stream_gives_the_same_tokens(mode):
    """A CSA layer's indexer chain on the side stream (``model.side``), eager and in graphs, gives
    the tokens of the one-stream step; the prompts are longer than the tiny preset's top-k covers,
    so the indexer scores. Control: the same steps with a smaller top-k give other tokens, so the
    comparison sees the indexer's choice."""
    from v4stack.model import side
    from v4stack.model.attention import Attention

    model = V4Model(preset("tiny"), seed=3).cast(torch.bfloat16).eval().cuda()
    sp = SamplingParams(max_tokens=24)

    def run(stream: bool, graphs: bool):
        was = Attention.index_stream
        Attention.index_stream = stream
        try:
            before = side.Fork.made
            eng = Engine(model, EngineConfig(n_blocks=64, n_slots=8, n_snapshots=0, ops_mode=mode, cuda_graphs=graphs,
                                             overlap=graphs))
            out = [r.output for r in eng.generate(_prompts(), sp)]
            return out, side.Fork.made - before
        finally:
            Attention.index_stream = was

    one, forks = run(False, True)
    assert forks == 0
    for graphs in (False, True):
        two, forks = run(True, graphs)
        assert forks > 0 and two == one, graphs
    idx = [m for m in model.modules() if isinstance(m, Attention) and m.indexer is not None]
    assert idx and all(a.indexer.topk < 40 // a.ratio for a in idx)  # the longest prompt's entries pass the top-k
    k0 = idx[0].indexer.topk
    for a in idx:
        a.indexer.topk = 1
    try:
        other, _ = run(True, True)
    finally:
        for a in idx:
            a.indexer.topk = k0
    assert other != one
