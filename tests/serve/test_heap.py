"""``serve.heap``: what ``settle`` freezes leaves the collector's oldest generation, so a full
collection no longer walks it; ``thaw`` puts it back. Control: without ``settle`` the objects stay."""

import gc

from v4stack.serve import heap
from v4stack.serve.sampling import Draw, DrawLog


def test_settle_moves_the_heap_out_of_full_collections():
    kept = [[i] for i in range(20000)]  # tracked containers that outlive the collection
    gc.collect()
    before = len(gc.get_objects(generation=2))
    assert before > len(kept)  # control: collected, not frozen - still walked
    try:
        frozen = heap.settle()
        assert frozen >= len(kept)
        assert len(gc.get_objects(generation=2)) < before - len(kept)
    finally:
        heap.thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert len(gc.get_objects(generation=2)) >= len(kept)


def test_draw_log_reads_as_a_list_of_draws():
    draws = [Draw(i, -0.5 * i, [(i, -0.1)] if i % 3 == 0 else None, -0.25 * i) for i in range(10)]
    log = DrawLog(draws[:4])
    log += draws[4:]
    assert len(log) == 10 and list(log) == draws
    assert log[-1] == draws[-1] and log[3] == draws[3] and log[2:7] == draws[2:7] and log[-3:] == draws[-3:]
    assert log[0].top == [(0, -0.1)] and log[1].top is None
    assert sum(log.logprobs) == sum(d.logprob for d in draws)
    try:
        log[10]
    except IndexError:
        pass
    else:
        raise AssertionError("index past the end must raise")
