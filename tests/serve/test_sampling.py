"""The batched sampler: counter-based draws, every option, logprobs; and the engine's token-id
stops (EOS, ignore_eos, stop_token_ids, min_tokens) and fresh seeds."""

import math

import pytest
import torch

from v4stack.serve.sampling import Row, Sampler, SamplingParams, sample, uniform


def _logits(b=4, v=256, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_draw_depends_on_seed_and_index_only_not_on_the_batch():
    x = _logits(6)
    rows = [Row(SamplingParams(temperature=0.9, top_p=0.95, top_k=40, min_p=0.01, seed=s), s, i)
            for s, i in zip(range(6), (0, 3, 1, 7, 2, 5))]
    together = [d.token for d in sample(x, rows)]
    alone = [sample(x[b : b + 1], [rows[b]])[0].token for b in range(6)]
    reversed_ = [d.token for d in sample(x.flip(0), rows[::-1])][::-1]
    assert together == alone == reversed_
    # the inverse control: another index (or seed) draws another uniform and, over many rows, other tokens
    other = [d.token for d in sample(x, [Row(r.params, r.seed, r.index + 1) for r in rows])]
    assert other != together
    assert uniform(5, 3) == uniform(5, 3) != uniform(5, 4) != uniform(6, 3)


def test_tiny_temperature_is_greedy_not_nan():
    x = _logits(1)
    for t in (1e-309, 1e-300, 1e-6):
        d = sample(x, [Row(SamplingParams(temperature=t), 1, 0)])[0]
        assert d.token == int(x[0].argmax()) and math.isfinite(d.logprob)


def test_truncations_keep_only_allowed_tokens():
    x = _logits(1)
    order = x[0].argsort(descending=True).tolist()
    for i in range(30):
        t = sample(x, [Row(SamplingParams(temperature=2.0, top_k=3), i, i)])[0].token
        assert t in order[:3]
        assert sample(x, [Row(SamplingParams(temperature=2.0, min_p=1.0), i, i)])[0].token == order[0]
    p = torch.softmax(x[0].double(), -1)[order]
    need = int((p.cumsum(0) < 0.5).sum()) + 1
    assert {sample(x, [Row(SamplingParams(temperature=1.0, top_p=0.5), i, i)])[0].token for i in range(60)} <= set(order[:need])


def test_penalties_bias_and_min_tokens():
    x = torch.zeros(1, 256)
    x[0, 10] = 5.0
    x[0, 11] = 4.0
    greedy = SamplingParams()
    assert sample(x, [Row(greedy, 0, 0)])[0].token == 10
    assert sample(x, [Row(SamplingParams(logit_bias={42: 100.0}), 0, 0)])[0].token == 42
    assert sample(x, [Row(SamplingParams(frequency_penalty=2.0), 0, 3, output=[10])])[0].token == 11
    assert sample(x, [Row(SamplingParams(presence_penalty=1.5), 0, 3, output=[10, 10])])[0].token == 11
    assert sample(x, [Row(SamplingParams(repetition_penalty=2.0), 0, 0, prompt=[10])])[0].token == 11
    mt = SamplingParams(min_tokens=2, max_tokens=4)
    assert sample(x, [Row(mt, 0, 1, no_stop_ids=(10,))])[0].token == 11  # stop id masked before min_tokens
    assert sample(x, [Row(mt, 0, 2, no_stop_ids=(10,))])[0].token == 10


def test_logprobs_are_the_models_distribution():
    x = _logits(2)
    rows = [Row(SamplingParams(temperature=0.7, logprobs=5), 3, 0), Row(SamplingParams(logprobs=0), 3, 0)]
    d = sample(x, rows)
    ref = torch.log_softmax(x, -1)
    assert d[0].logprob == pytest.approx(float(ref[0, d[0].token]), abs=1e-6)
    assert [t for t, _ in d[0].top] == ref[0].argsort(descending=True)[:5].tolist()
    assert d[1].top == () and d[1].token == int(x[1].argmax())


def test_sampler_advance_is_a_counter():
    x = _logits(12)
    sp = SamplingParams(temperature=0.8, seed=4)
    a, b = Sampler(sp), Sampler(sp)
    whole = [a(x[i]) for i in range(12)]
    b.advance(7)
    assert [b(x[i]) for i in range(7, 12)] == whole[7:]


def test_params_checks():
    for bad in (dict(temperature=float("nan")), dict(min_p=2.0), dict(seed=2**64), dict(min_tokens=5, max_tokens=2),
                dict(logit_bias={1: 101.0}), dict(logprobs=21), dict(repetition_penalty=0.0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate()


@pytest.fixture(scope="module")
def tiny():
    from v4stack.config import preset
    from v4stack.model import V4Model

    return V4Model(preset("tiny"), seed=0).cast(torch.float32).eval()


def test_engine_stops_on_eos_unless_ignored_and_on_stop_ids(tiny):
    from v4stack.serve.engine import Engine, EngineConfig

    prompt = list(b"stop on ids")
    g = Engine(tiny, EngineConfig(n_blocks=64, n_slots=4)).generate([prompt], SamplingParams(max_tokens=8))[0].output
    eos = g[2]
    k = g.index(eos)
    e = Engine(tiny, EngineConfig(n_blocks=64, n_slots=4, eos_token_id=eos))
    r_eos, r_ign, r_ids = e.generate([prompt] * 3, [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, ignore_eos=True),
                                                    SamplingParams(max_tokens=8, stop_token_ids=(g[1],), ignore_eos=True)])
    assert r_eos.output == g[: k + 1] and r_eos.finish_reason == "stop" and r_eos.stop_reason == eos
    assert r_ign.output == g and r_ign.finish_reason == "length"
    assert r_ids.output == g[: g.index(g[1]) + 1] and r_ids.finish_reason == "stop"


def test_engine_gives_a_fresh_recorded_seed(tiny):
    from v4stack.serve.engine import Engine, EngineConfig

    e = Engine(tiny, EngineConfig(n_blocks=64, n_slots=4))
    a, b = e.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=6, temperature=1.0))
    assert a.params.seed is not None and a.params.seed != b.params.seed and a.output != b.output
    c = e.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=1.0, seed=a.params.seed))[0]
    assert c.output == a.output  # the recorded seed replays the request


def test_mixed_batch_rows_equal_rows_alone_and_policy_logprob_in_float64_on_cpu():
    x = _logits(5, seed=3)
    ps = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=1.3, min_tokens=3),
          SamplingParams(logit_bias={7: 100.0}), SamplingParams(temperature=0.5, top_p=0.8, min_p=0.02)]
    rows = [Row(p, 11 + b, b) for b, p in enumerate(ps)]
    rows[2].no_stop_ids = tuple(range(x.shape[1]))  # everything masked: the row falls back to the model's logits
    together = sample(x, rows)
    alone = [sample(x[b : b + 1], [rows[b]])[0] for b in range(5)]
    assert [(d.token, d.logprob, d.sampled_logprob) for d in together] == \
        [(d.token, d.logprob, d.sampled_logprob) for d in alone]
    assert together[0].token == int(x[0].argmax()) and together[3].token == 7
    for d, r in zip(together, rows):  # the policy's log-probability, float64 maths on the CPU
        t = 1.0 if r.params.greedy else r.params.temperature
        z = x[rows.index(r)].double() / t
        assert d.sampled_logprob == pytest.approx(min(0.0, float(z[d.token] - torch.logsumexp(z, -1))), abs=1e-12)
    # inverse control: another draw index changes some sampled token
    moved = sample(x, [Row(r.params, r.seed, r.index + 5) for r in rows])
    assert [d.token for d in moved] != [d.token for d in together]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_sampling_waits_once_and_matches_the_cpu_tokens():
    import warnings

    x = _logits(6, v=4096, seed=5)
    rows = [Row(SamplingParams(temperature=0.0 if b % 2 else 0.9, top_k=50, top_p=0.9), b, b) for b in range(6)]
    xc = x.cuda()
    sample(xc, rows)  # warm-up (kernel builds)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = sample(xc, rows)
            synced = len(w)
            with warnings.catch_warnings(record=True) as ctl:  # control: the detector sees a read-back
                warnings.simplefilter("always")
                xc[0, 0].item()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(ctl) >= 1 and synced <= 1
    cpu = sample(x, rows)
    assert [d.token for d in got] == [d.token for d in cpu]
    for a, b in zip(got, cpu):
        assert abs(a.logprob - b.logprob) < 1e-4 and abs(a.sampled_logprob - b.sampled_logprob) < 1e-4


def test_greedy_draw_kernel_matches_float64_first_maximum_and_is_row_local():
    """``triton_sample.greedy_draw`` (Triton's interpreter on the CPU): the first maximum's id, its
    log-probability to fp32 rounding, row-local bits; the torch reference agrees."""
    ts = pytest.importorskip("v4stack.kernels.triton_sample")
    from v4stack.ops import fused

    x = _logits(5, v=9000, seed=9)  # three chunks, the last one ragged: masked tails
    x[1, 8500] = x[1, 2100] = x[1, 7] = x[1].max() + 1  # ties across blocks and chunks: the first column wins
    x[3, -1] = x[3].max() + 2  # the maximum in the masked block
    x[2, 4099] = x[2, 4097] = x[2].max() + 1  # a tie inside one of the lean form's rows of 8 columns
    # the shipped tile, and the lean form (two blocks and a ragged third: 9000 columns in blocks of 4096)
    lean = dict(CHUNK=4096, BLOCK=4096, num_warps=4, lean=8)
    for xx, tile in ((x, None), (x.bfloat16(), None), (x, lean), (x.bfloat16(), lean)):
        tok, out = ts.greedy_draw(xx, tile)
        want = xx.double().argmax(-1)
        assert tok.tolist() == want.tolist() and tok[1] == 7 and tok[2] == 4097
        lp = torch.log_softmax(xx.double(), -1).gather(1, want[:, None])[:, 0]
        torch.testing.assert_close(out[:, 1], lp, atol=2e-6, rtol=0)
        assert torch.equal(out[:, 0], tok.double()) and torch.equal(out[:, 2], out[:, 1].clamp(max=0))
        alone_tok, alone = ts.greedy_draw(xx[3:4].clone(), tile)
        assert torch.equal(alone[0], out[3])
        rt, ro = fused.greedy_draw_reference(xx)
        assert torch.equal(rt, tok) and torch.allclose(ro, out, atol=2e-6, rtol=0)
        if tile:  # the shipped tile's ids; log-probabilities to fp32 rounding
            st, so = ts.greedy_draw(xx)
            assert torch.equal(st, tok) and torch.allclose(so, out, atol=2e-6, rtol=0)
    # inverse control: the last maximum is another column
    assert int(x.shape[1] - 1 - x[1].flip(0).argmax()) != int(tok[1])


def test_the_lean_greedy_build_issues_fewer_instructions():
    """The greedy draw is bound by its instructions a column (the same time on an H100 as on an H200):
    the lean form's sm_90a build, as a step launches it, issues at most two thirds of the block form's
    instructions, in fewer registers, without spills."""
    pytest.importorskip("triton")
    from tests.ops.hopper import registers

    got = registers(("greedy_lean", "greedy_blocks"))
    lean, blocks = got["greedy_lean"], got["greedy_blocks"]
    if lean["instructions"] is None:
        pytest.skip("no cuobjdump bundled with Triton")
    assert lean["spill_bytes"] == 0 and lean["registers"] < blocks["registers"]
    assert 3 * lean["instructions"] <= 2 * blocks["instructions"]


def test_greedy_tile_from_the_environment_is_checked():
    """``V4STACK_GREEDY_TILE``: unset gives the shipped tile; a bench tile's JSON gives that tile; what
    would launch a wrong shape is refused with the variable's name."""
    ts = pytest.importorskip("v4stack.kernels.triton_sample")

    assert ts.tile_from(None) == ts.SHIPPED == ts.tile_from("")
    lean = '{"CHUNK": 2048, "BLOCK": 2048, "num_warps": 2, "lean": 8}'
    assert ts.tile_from(lean) == dict(CHUNK=2048, BLOCK=2048, num_warps=2, lean=8)
    assert ts.tile_from('{"CHUNK": 4096, "BLOCK": 1024, "num_warps": 4}')["CHUNK"] == 4096
    base = '"CHUNK": 2048, "BLOCK": 2048, "num_warps": '
    for bad in ("lean", "[2048]", '{"CHUNK": 2048, "BLOCK": 2048}', "{" + base + '2, "x": 1}', "{" + base + "3}",
                '{"CHUNK": 4096, "BLOCK": 2048, "num_warps": 2, "lean": 8}', "{" + base + '2, "lean": 0}',
                '{"CHUNK": 3000, "BLOCK": 2048, "num_warps": 2}', "{" + base + "true}", "{" + base + '2, "blocks": 1}'):
        with pytest.raises(ValueError, match="V4STACK_GREEDY_TILE"):
            ts.tile_from(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_all_greedy_step_is_one_kernel_on_the_device_and_matches_the_cpu():
    from v4stack import ops

    x = _logits(7, v=129_280, seed=6).bfloat16()
    rows = [Row(SamplingParams(), b, b) for b in range(7)]
    for mode in ("fast", "invariant"):
        ops.reset_counters()
        with ops.mode(mode):
            got = sample(x.cuda(), rows)
        assert "triton_greedy_draw" in str(ops.counters())
        cpu = sample(x.float(), rows)
        assert [d.token for d in got] == [d.token for d in cpu]
        for a, b in zip(got, cpu):
            assert abs(a.logprob - b.logprob) < 1e-4 and abs(a.sampled_logprob - b.sampled_logprob) < 1e-4


def test_plain_rows_draw_the_same_through_the_greedy_launch():
    """``sample_greedy_async`` (rows that are all ``SamplingParams.plain``) gives the bits the
    per-row path gives; ``plain`` is false for every parameter that needs the per-row path."""
    from v4stack.serve.sampling import sample_greedy_async

    x = _logits(9, v=300, seed=11)
    rows = [Row(SamplingParams(max_tokens=4), b, b) for b in range(9)]
    assert all(r.params.plain for r in rows)
    want = sample(x, rows)
    got = sample_greedy_async(x).collect()
    assert [(d.token, d.logprob, d.sampled_logprob, d.top) for d in got] == \
        [(d.token, d.logprob, d.sampled_logprob, d.top) for d in want]
    for change in (dict(temperature=0.5), dict(logprobs=0), dict(logit_bias={3: 1.0}), dict(min_tokens=1),
                   dict(repetition_penalty=1.1), dict(presence_penalty=0.1), dict(frequency_penalty=0.1)):
        assert not SamplingParams(max_tokens=4, **change).plain, change
    # inverse control: a row that asks for log-probabilities gets a report the greedy launch omits
    asked = sample(x, [Row(SamplingParams(logprobs=0), b, b) for b in range(9)])
    assert [d.top for d in asked] != [d.top for d in got]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_launches_in_flight_together_read_their_own_tokens():
    """Two greedy launches unread at once (the overlapped engine's case) each read back their own
    rows; a read buffer is reused by the next launch."""
    from v4stack.serve import sampling as sm

    xs = [_logits(16, v=129_280, seed=s).bfloat16() for s in (21, 22, 23)]
    cpu = [[d.token for d in sm.sample(x.float(), [Row(SamplingParams(), b, b) for b in range(16)])] for x in xs]
    key = ((16, 3), torch.float64)
    sm._PINNED.free.pop(key, None)  # no buffer of this shape read before
    a = sm.sample_greedy_async(xs[0].cuda())
    b = sm.sample_greedy_async(xs[1].cuda())
    assert a._host.data_ptr() != b._host.data_ptr()
    assert [d.token for d in b.collect()] == cpu[1] and [d.token for d in a.collect()] == cpu[0]
    reused = {a._pinned, b._pinned} == {None}
    c = sm.sample_greedy_async(xs[2].cuda())
    assert reused and len(sm._PINNED.free.get(key, [])) == 1  # one of the two read buffers taken again
    assert [d.token for d in c.collect()] == cpu[2]
    assert cpu[0] != cpu[1]  # control: the two launches' tokens differ, so a swap would show
