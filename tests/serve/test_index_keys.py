"""The indexer keys in V4's cache format (``EngineConfig.index_keys``, ``ops/fp8_keys.py``).

Where the model runs V4's activation rounding, the engine stores packed e4m3 rows (144 bytes a key at V4's width;
here the tiny preset's 32 against 64 in float32) hold the keys exactly, and serving stays exact: in
invariant mode every logit equals the model's own incremental path (which keeps its keys unpacked),
the engine's tokens and log-probabilities equal those of an engine that stores the keys in the model
dtype, and a prefix restored from disk is exact. Inverse controls: packing keys the model did not
round changes the logits and the tokens. The prompts are long enough that the indexer scores (more
entries than its top-k)."""

import pytest
import torch

from v4stack import check, ops
from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.model.quant import set_act_rounding
from v4stack.serve.cache.manager import CacheManager
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams

CFG = preset("tiny")


def _model(rounding: bool):
    m = V4Model(CFG, seed=2).eval()
    return set_act_rounding(m, True) if rounding else m


def _differing(model) -> int:
    reqs = check.make_requests(4, seed=1, vocab=CFG.vocab_size, max_prompt=48, decode=6)
    assert max(sum(len(c) for c in r.chunks) for r in reqs) // 4 > CFG.index_topk  # the indexer scores
    with ops.mode("invariant"), torch.no_grad():
        alone, batched = check.run_alone(model, reqs), check.run_batched(model, reqs, 3, seed=0)
    return sum(int(not torch.equal(torch.cat(alone[k]), torch.cat(batched[k]))) for k in alone)


def test_packed_keys_serve_the_models_own_logits(monkeypatch):
    seen = []
    init = CacheManager.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        seen.append({g.kind: (g.width, g.dtype) for g in self.spec.paged}["index_keys"])

    monkeypatch.setattr(CacheManager, "__init__", spy)
    assert _differing(_model(True)) == 0
    assert seen[-1] == (32, torch.uint8)  # the check's serving path stored V4's keys, as the engine does
    # control: the same packing of keys the model never rounded loses bits the scores see
    monkeypatch.setattr(CacheManager, "__init__", lambda self, *a, **kw: spy(self, *a, **{**kw, "index_fp8": True}))
    assert _differing(_model(False)) > 0


def _tokens(model, index_keys: str):
    eng = Engine(model, EngineConfig(n_blocks=64, n_slots=4, max_running=4, ops_mode="invariant",
                                     index_keys=index_keys))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (41, 9, 30, 57)]
    reqs = [eng.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
    while eng.has_work():
        eng.step()
    return [(r.output, [d.logprob for d in r.draws]) for r in reqs], eng.cache.spec.bytes_per_token()


@torch.no_grad()
def test_the_engine_picks_v4s_keys_under_the_rounding():
    model = _model(True)
    packed, per_packed = _tokens(model, "auto")
    plain, per_plain = _tokens(model, "model")
    assert packed == plain
    csa = sum(1 for r in CFG.layer_ratios if r and CFG.is_csa(r))
    assert per_packed["index_keys"] == csa * 32 / 4 and per_plain["index_keys"] == csa * 16 * 4 / 4
    # without the rounding "auto" keeps the model dtype; control: "fp8" there rounds the keys, and
    # the log-probabilities move
    plain_off, per_off = _tokens(_model(False), "auto")
    assert per_off["index_keys"] == per_plain["index_keys"]
    assert _tokens(_model(False), "fp8")[0] != plain_off
    with pytest.raises(ValueError, match="index_keys"):
        EngineConfig(index_keys="fp4").validate()


@pytest.mark.parametrize("strategy", ["full", "none"])
def test_a_prefix_restored_from_disk_keeps_packed_keys_exact(tmp_path, strategy):
    """Packed key blocks go to disk and back as bytes; strategy "none" recomputes the window cone
    from the restored blocks, unpacking the keys into the model's own state."""
    from v4stack.serve.cache.disk import DiskPrefixStore
    from tests.rollout.test_prefix_store import first_logits, prompt

    model = _model(True)

    def engine():
        eng = Engine(model, EngineConfig(n_blocks=64, n_slots=4))
        assert eng.cache.blocks.storage[("index_keys", 2)].dtype == torch.uint8
        return eng

    base = prompt(130)
    full = base[:127] + prompt(5, salt=127)
    ref_logits, ref_out, _ = first_logits(engine(), full)
    warm = engine()
    first_logits(warm, base[:127] + [7, 7, 7])
    assert DiskPrefixStore(tmp_path, warm.cache, strategy, model=model).save(base[:127]) > 0
    cold = engine()
    info = DiskPrefixStore(tmp_path, cold.cache, strategy, model=model).restore(full)
    assert info.hit_tokens == 112
    logits, out, _ = first_logits(cold, full)
    assert torch.equal(logits, ref_logits[-logits.shape[0]:]) and out == ref_out


def test_the_serve_command_takes_the_key_format(monkeypatch):
    from typer.testing import CliRunner

    from v4stack import cli
    from v4stack.serve import server

    got = []
    monkeypatch.setattr(server, "serve", lambda cfg, model, name, host, port, ecfg, **kw: got.append(ecfg))
    res = CliRunner().invoke(cli.app, ["serve", "--preset", "tiny", "--index-keys", "fp8"])
    assert res.exit_code == 0 and got[-1].index_keys == "fp8"
    res = CliRunner().invoke(cli.app, ["serve", "--preset", "tiny", "--index-keys", "fp4"])
    assert res.exit_code == 2 and "index_keys" in res.output and len(got) == 1  # refused before serving


def test_the_invariance_check_runs_v4s_precision():
    """``v4stack check invariance --act-rounding``: the model under V4's rounding, its serving path
    on packed keys, bit-invariant; control: fast mode differs."""
    import json

    from typer.testing import CliRunner

    res = CliRunner().invoke(check.app, ["invariance", "--prompts", "4", "--act-rounding", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["act_rounding"] is True and rep["invariant"] is True and rep["steps_compared"] > 0
    fast = check.check_invariance(prompts=4, mode="fast", act_rounding=True)
    assert fast["steps_differ"] > 0
