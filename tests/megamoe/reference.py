"""The single-process routed layer the expert-parallel backends must equal: the model's own local
backend (``LocalGrouped``: every expert on one process, one grouped GEMM per projection, the
pair outputs combined per token by ``ops.moe_combine``). Nothing here comes from ``megamoe``."""

from v4stack.model.moe import LocalGrouped


def single_process_routed(moe, x, w, idx):
    return LocalGrouped()(moe, x, w, idx)
