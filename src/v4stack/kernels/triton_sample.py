"""Greedy draws of a whole decode step in one kernel (Triton): ``ops.fused.greedy_draw``.

One program per row streams the row's logits once (any float dtype, read as fp32) in blocks of
``BLOCK``: each lane keeps its running maximum, the sum of ``exp(x - max)`` rescaled as the
maximum rises, and the first column where its maximum was seen. The lanes are then combined in
one fixed order: ``M = max``, ``S = sum(s_lane exp(m_lane - M))``, the token is the smallest
column holding ``M`` (``torch.argmax``'s first maximum), and its log-probability is ``x[tok] - M -
log S = -log S``. The order depends on the vocabulary width alone, so a row's bits never depend on
the batch. The kernel writes the ids ``[B]`` (int64, the next step's inputs) and the ``[B, 3]``
float64 rows the sampler reads back: id, log-probability, and the policy log-probability (the
same at temperature 1, clamped at 0).
"""

import torch
import triton
import triton.language as tl

from v4stack.kernels.launch import launch

BLOCK = 1024


@triton.jit
def greedy_kernel(X, TOK, OUT, V, s_x, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mv = tl.full([BLOCK], float("-inf"), tl.float32)
    sv = tl.zeros([BLOCK], tl.float32)
    iv = tl.zeros([BLOCK], tl.int32)
    for v0 in range(0, V, BLOCK):
        col = v0 + offs
        ok = col < V
        x = tl.load(X + r * s_x + col, mask=ok, other=float("-inf")).to(tl.float32)
        nm = tl.maximum(mv, x)
        keep = tl.where(mv == float("-inf"), 0.0, sv * tl.exp(mv - nm))
        sv = keep + tl.where(ok, tl.exp(x - nm), 0.0)
        iv = tl.where(x > mv, col, iv)  # strictly greater: a lane keeps its first maximum
        mv = nm
    M = tl.max(mv, 0)
    S = tl.sum(tl.where(mv == float("-inf"), 0.0, sv * tl.exp(mv - M)), 0)
    tok = tl.min(tl.where(mv == M, iv, V), 0)
    lp = -tl.log(S)
    tl.store(TOK + r, tok.to(tl.int64))
    tl.store(OUT + r * 3, tok.to(tl.float64))
    tl.store(OUT + r * 3 + 1, lp.to(tl.float64))
    tl.store(OUT + r * 3 + 2, tl.minimum(lp, 0.0).to(tl.float64))


def greedy_draw(logits: torch.Tensor):
    B, V = logits.shape
    tok = torch.empty(B, dtype=torch.int64, device=logits.device)
    out = torch.empty(B, 3, dtype=torch.float64, device=logits.device)
    if B:
        launch(greedy_kernel, (B,), logits, tok, out, V, logits.stride(0), BLOCK=BLOCK, num_warps=4)
    return tok, out
