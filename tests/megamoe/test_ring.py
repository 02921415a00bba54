"""The ring's back-pressure with real threads: a producer cannot run more than ``slots`` tiles
ahead of the consumer, and a producer failure reaches a waiting consumer."""

import threading
import time

import pytest

from v4stack.megamoe.pull import _Ring


def test_producer_blocks_on_a_full_ring():
    ring = _Ring(slots=2)
    produced_before_free = []

    def producer():
        for _ in range(5):
            ring.wait_free()
            ring.publish()

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    ring.wait_produced(2)
    time.sleep(0.2)  # the producer had time to run ahead, and must not have
    produced_before_free.append(ring.produced)
    for i in range(5):
        ring.wait_produced(i + 1)
        ring.free(1)
    t.join(timeout=5)
    assert produced_before_free == [2]
    assert ring.produced == 5 and ring.peak == 2


def test_puller_failure_reaches_the_consumer():
    ring = _Ring(slots=2)
    threading.Thread(target=lambda: ring.fail(OSError("peer buffer gone")), daemon=True).start()
    with pytest.raises(RuntimeError, match="puller failed"):
        ring.wait_produced(1)
