"""The decode layout's block tables, kept per state slot between steps (``ModelRunner._refresh_tables``):
whatever the sequence of steps - blocks appended, a request freed and its slot refilled by another
(a new, shorter list), a new admission - every step's table equals the one built from scratch
(each request's blocks, then -1), while a step copies only the ids that are new to a slot."""

import numpy as np
import torch

from v4stack.config import preset
from v4stack.serve.cache.manager import CacheManager, RequestCache
from v4stack.serve.model_runner import ModelRunner


class _Model:  # what the runner reads of a model
    def __init__(self, cfg):
        self.cfg = cfg
        self.embed = torch.nn.Embedding(1, 1)


def _runner():
    cfg = preset("tiny")
    cache = CacheManager(cfg, torch.float32, n_blocks=64, n_slots=4)
    return ModelRunner(_Model(cfg), cache), cache


def _table(runner, chunks, width):
    rows = 1 << max(0, len(chunks) - 1).bit_length()
    host = runner.decode_host(chunks, rows, width, (0,) * (len(runner.ratios) + 1)).numpy()
    return host[5 * rows: 5 * rows + rows * width].reshape(rows, width)


def _want(chunks, rows, width):
    t = np.full((rows, width), -1, dtype=np.int64)
    for i, (rc, _) in enumerate(chunks):
        t[i, : len(rc.blocks)] = rc.blocks
    return t


def test_tables_kept_per_slot_equal_the_tables_built_from_scratch():
    runner, _ = _runner()
    a, b = RequestCache(slot=0, blocks=[5, 6, 7]), RequestCache(slot=1, blocks=[9])
    steps = []
    steps.append([(a, [1]), (b, [1])])
    a.blocks.append(8)  # grows in place
    steps.append([(a, [1]), (b, [1])])
    c = RequestCache(slot=0, blocks=[3])  # a freed; its slot refilled by a shorter request
    steps.append([(b, [1]), (c, [1])])
    d = RequestCache(slot=2, blocks=list(range(10, 30)))  # wider than any table so far
    c.blocks += [4, 2]
    steps.append([(d, [1]), (c, [1]), (b, [1])])
    steps.append([(c, [1])])
    for chunks in steps:
        width = max(len(rc.blocks) for rc, _ in chunks) + 2
        rows = 1 << max(0, len(chunks) - 1).bit_length()
        assert np.array_equal(_table(runner, chunks, width), _want(chunks, rows, width))
    # only what is new moves: a step where no request has a new block writes none of the kept rows
    # (a mark put into c's row shows in the next table; a rewrite would have cleared it), and an
    # appended block writes just its own column (the mark stays)
    runner._tab[c.slot, 0] = 999
    assert _table(runner, [(c, [1]), (d, [1])], 24)[0, 0] == 999
    c.blocks.append(1)
    t = _table(runner, [(c, [1])], 24)
    assert t[0, 0] == 999 and t[0, len(c.blocks) - 1] == 1


def test_a_list_changed_in_place_at_its_length_is_not_seen():
    # inverse control: the kept rows trust that block lists only grow in place (the cache manager
    # replaces a list, never rewrites one); a list rewritten in place at the same length is stale,
    # so the comparison above is one that can fail
    runner, _ = _runner()
    a = RequestCache(slot=0, blocks=[5, 6])
    _table(runner, [(a, [1])], 4)
    a.blocks[1] = 11
    assert not np.array_equal(_table(runner, [(a, [1])], 4), _want([(a, [1])], 1, 4))
