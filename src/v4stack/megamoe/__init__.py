"""Expert-parallel MoE: the overlap budget and wave planner, symmetric buffers, the pull-based
MegaMoE transport and its device-side pipeline, the ``all_to_all_single`` baseline, and the
backends (with autograd) that plug into the model's expert seam."""

from v4stack.megamoe.backend import PATHS, ExpertParallel, expert_parallel_factory, make_transport
from v4stack.megamoe.baseline import AllToAllTransport
from v4stack.megamoe.experts import LocalExperts, reduce_pairs, route_order
from v4stack.megamoe.plan import H200, Hardware, WavePlan, overlap_budget, plan_waves
from v4stack.megamoe.pull import SymmetricTransport
from v4stack.megamoe.symm import CudaSymmetric, ShmSymmetric, SymmetricBuffer, symmetric_buffer

__all__ = [
    "PATHS", "AllToAllTransport", "CudaSymmetric", "ExpertParallel", "H200", "Hardware", "LocalExperts",
    "ShmSymmetric", "SymmetricBuffer", "SymmetricTransport", "WavePlan", "expert_parallel_factory",
    "make_transport", "overlap_budget", "plan_waves", "reduce_pairs", "route_order", "symmetric_buffer",
]
