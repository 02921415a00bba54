"""The device-side pipeline's protocol on CPU: the same Triton kernels under ``TRITON_INTERPRET=1``
on gloo processes with shared-memory symmetric buffers. Checks the index maps, waves, ring reuse
(one expert per wave, two slots) and the push combine: the pipeline equals the all-to-all baseline
running the same kernels bitwise, and the single-process layer to fp32 rounding. (The interpreter
has no bf16 matmul, so the GEMM operands are fp32 here; on GPUs they are bf16.)"""

import pytest
import torch

from tests.megamoe.common import make_moe, offsets
from tests.megamoe.reference import single_process_routed
from tests.optim.distributed import run_world
from v4stack.config import preset
from v4stack.megamoe.backend import ExpertParallel, expert_parallel_factory, make_transport
from v4stack.model import V4Model
from v4stack.megamoe.experts import LocalExperts
from v4stack.megamoe.routing import routing


def _world(rank, world):
    from v4stack.megamoe.pipeline import DevicePipeline

    moe = make_moe(topk=2, seed=1)
    ex = LocalExperts(moe, rank, world)
    a2a = ExpertParallel(moe, make_transport("all_to_all", n_experts=8, topk=2, hidden=64, max_tokens=12),
                         kernels=True, kernel_dtype=torch.float32)
    for per_wave, (kind, counts) in ((1, ("zipf", [9, 6])), (None, ("uniform", [12, 0]))):
        pipe = DevicePipeline(ex, max_tokens=12, device="cpu", weight_dtype=torch.float32, wave_experts=per_wave)
        off = offsets(counts)
        mine = slice(off[rank], off[rank + 1])
        g = torch.Generator().manual_seed(3)
        x = torch.randn(off[-1], 64, generator=g).to(torch.bfloat16)
        idx, w = routing(kind, off[-1], 8, 2, g)
        with torch.no_grad():
            got = pipe(x[mine], w[mine], idx[mine])
            assert len(pipe.last_waves) == (4 if per_wave else 1)
            assert torch.equal(got, a2a(moe, x[mine], w[mine], idx[mine]))
            torch.testing.assert_close(got, single_process_routed(moe, x, w, idx)[mine], rtol=1e-5, atol=1e-5)
        pipe.close()
    # the model with the pipeline installed by the factory (shared buffers, bound per layer)
    cfg = preset("tiny")
    toks = torch.randint(0, cfg.vocab_size, (1, 4 + 3 * rank), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        want = V4Model(cfg, seed=1).eval()(toks)
        model = V4Model(cfg, seed=1).eval().set_expert_backend(expert_parallel_factory(
            "megamoe", max_tokens=8, pipeline=True, pipeline_opts=dict(weight_dtype=torch.float32)))
        assert model.layers[-1].ffn.backend.pipeline is not None
        # rows are dispatched in bf16 here, so close to the fp32 model, not equal
        torch.testing.assert_close(model(toks), want, rtol=0.05, atol=0.05)


@pytest.mark.slow
def test_pipeline_protocol_under_the_triton_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_world(_world, 2)
