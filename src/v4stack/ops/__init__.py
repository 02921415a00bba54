"""Every reduction the model does goes through this package.

The model calls these functions only; which implementation runs is chosen by the active mode
(``fast`` today: framework defaults). Keeping the call sites here is what lets a batch-invariant
mode replace the reductions without touching the model.
"""

from v4stack.ops.core import (
    attention_with_sink,
    hc_mix,
    indexer_scores,
    linear,
    rms_norm,
    softmax,
    weighted_pool,
)

__all__ = [
    "attention_with_sink",
    "hc_mix",
    "indexer_scores",
    "linear",
    "rms_norm",
    "softmax",
    "weighted_pool",
]
