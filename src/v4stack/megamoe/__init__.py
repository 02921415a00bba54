"""Expert-parallel MoE: the overlap budget and wave planner, symmetric buffers, the pull-based
MegaMoE path and the ``all_to_all_single`` baseline, both with the same fixed-order math."""

from v4stack.megamoe.baseline import AllToAllMoE
from v4stack.megamoe.experts import ExpertShard, reduce_topk, reference_moe, reference_routed, shared_expert
from v4stack.megamoe.plan import H200, Hardware, WavePlan, overlap_budget, plan_waves
from v4stack.megamoe.pull import MegaMoE
from v4stack.megamoe.symm import CudaSymmetric, ShmSymmetric, SymmetricBuffer, symmetric_buffer

__all__ = [
    "AllToAllMoE", "CudaSymmetric", "ExpertShard", "H200", "Hardware", "MegaMoE", "ShmSymmetric",
    "SymmetricBuffer", "WavePlan", "overlap_budget", "plan_waves", "reduce_topk", "reference_moe",
    "reference_routed", "shared_expert", "symmetric_buffer",
]
