"""The model check's build and its shared-model entry point (``v4stack.check``, ``bench.model_check``).

- on the CPU ``build_model`` is the seeded model (bitwise), and ``init_weights`` with an explicit
  CPU device draws the same numbers as without one;
- ``check_invariance(model=...)`` reuses a built model, reports wall time per phase, and its
  verdicts hold: invariant mode 0 steps differ, the fast-mode control differs (it can fail);
- ``bench.model_check`` runs its phases on one build and writes the decode times of both modes.
"""

import json

import torch

from v4stack import check
from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.model.init import init_weights


def test_build_model_on_cpu_is_the_seeded_model():
    a = check.build_model("tiny", "float32", "cpu", seed=3)
    b = V4Model(preset("tiny"), seed=3)
    c = V4Model(preset("tiny"), seed=None)
    init_weights(c, 3, device="cpu")
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q) and torch.equal(p, r), n
    assert not torch.equal(a.embed.weight, check.build_model("tiny", "float32", "cpu", seed=4).embed.weight)


def test_check_with_a_shared_model_both_modes():
    model = check.build_model("tiny", "float32", "cpu", seed=0)
    inv = check.check_invariance(prompts=3, mode="invariant", batch_sizes=(3,), model=model, max_prompt=10, decode=2)
    assert inv["steps_differ"] == 0 and inv["invariant"] and inv["deterministic"] and inv["chunking_invariant"]
    assert set(inv["seconds"]) == {"setup", "alone", "batched", "again", "one_chunk"}
    fast = check.check_invariance(prompts=3, mode="fast", batch_sizes=(3,), model=model, max_prompt=10, decode=2)
    assert fast["steps_differ"] > 0  # the control: the same model and schedule, framework reductions


def test_model_check_bench_writes_decode_times(tmp_path):
    from bench import model_check

    out = tmp_path / "m.json"
    model_check.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "2",
                      "--decode-batches", "2", "--decode-steps", "2", "--phases", "decode", "--out", str(out)])
    rep = json.loads(out.read_text())["results"]
    for m in ("invariant", "fast"):
        d = rep["decode"][f"{m}_b2"]
        assert d["decode_steps"] > 0 and d["decode_step_s_p50"] > 0
    assert rep["decode_ratio"]["2"] > 0 and "build" in rep["seconds"]
