"""The serving engine choosing the expert backend by config: two gloo ranks, each running an engine
with ``expert_backend`` = ``all_to_all`` / ``megamoe`` on its own prompt (different lengths), give
the tokens and log-probabilities, bit for bit, of the single-process engine (invariant ops). Control:
an FP8 dispatch changes the log-probabilities, so the comparison sees the routed experts."""

import pytest
import torch

from tests.optim.distributed import run_world
from v4stack.config import preset
from v4stack.megamoe.backend import ExpertParallel, expert_parallel_factory
from v4stack.model import V4Model
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams


def _run(engine: Engine, prompt: list[int]):
    req = engine.generate([prompt], SamplingParams(max_tokens=4, logprobs=0))[0]
    return req.output, [d.logprob for d in req.draws]


def _world(rank, world):
    cfg = preset("tiny")
    prompt = torch.randint(0, cfg.vocab_size, (6 + 5 * rank,), generator=torch.Generator().manual_seed(rank)).tolist()
    small = dict(n_blocks=32, n_slots=4, token_budget=32, max_running=4)
    want = _run(Engine(V4Model(cfg, seed=1), EngineConfig(**small)), prompt)
    for path in ("all_to_all", "megamoe"):
        engine = Engine(V4Model(cfg, seed=1), EngineConfig(**small, expert_backend=path))
        assert all(isinstance(b.ffn.backend, ExpertParallel) for b in engine.model.layers)
        assert _run(engine, prompt) == want, path
    lossy = Engine(V4Model(cfg, seed=1), EngineConfig(**small, expert_backend="megamoe"))
    lossy.model.set_expert_backend(expert_parallel_factory("megamoe", max_tokens=64,
                                                           dispatch_dtype=torch.float8_e4m3fn))
    assert _run(lossy, prompt)[1] != want[1]


def test_expert_backend_needs_a_process_group():
    with pytest.raises(ValueError, match="'expert_backend' must be one of"):
        EngineConfig(expert_backend="deepep").validate()
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        Engine(V4Model(preset("tiny"), seed=1), EngineConfig(n_blocks=8, n_slots=2, expert_backend="megamoe"))


@pytest.mark.slow  # the default run calls _world inside test_exact's EP2 processes (spawns are slow)
def test_engine_through_expert_parallel_backends():
    run_world(_world, 2)
