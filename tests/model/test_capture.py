"""A state recorded at a position inside a chunk equals the state of a run that stopped there."""

import torch

from v4stack.ops.mode import mode

from .conftest import tokens


@torch.no_grad()
@mode("invariant")  # bitwise: chunking must not change a row's arithmetic
def test_capture_inside_chunk_equals_stopping_there(model64, tiny_cfg):
    t = tokens(60, seed=21)[0]
    for P in (16, 17, 31, 32, 48):
        ref = model64.new_state()
        model64.step([(t[:P], ref)])
        st = model64.new_state()
        model64.step([(t[:5], st)])
        for ls in st.layers:
            ls.capture_at = (P,)
        model64.step([(t[5:60], st)])
        for ratio, got, want in zip(tiny_cfg.layer_ratios, (ls.captured[P] for ls in st.layers), ref.layers):
            w = tiny_cfg.sliding_window
            idx = torch.arange(P - w, P) % w
            assert torch.equal(got.swa_kv[idx], want.swa_kv[idx]), (P, ratio)
            for a, b in ((got.tail, want.tail), (got.index_tail, want.index_tail)):
                if a is None:
                    assert b is None
                    continue
                m = ratio
                lookback = m if tiny_cfg.is_csa(ratio) else 0
                lo = max(0, (P // m) * m - lookback)
                rows = torch.arange(lo, P) % a.rows
                assert torch.equal(a.kv[rows], b.kv[rows]) and torch.equal(a.score[rows], b.score[rows])
