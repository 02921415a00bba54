"""Tile shapes of the Triton GEMMs, by size bucket (no Triton import: the contract proofs read
them too). A bucket changes an output tile's M x N shape only, never an element's K chain."""

# (largest M, tile); bf16 / fp16 stay on wgmma (BM >= 64, 4+ warps) in every bucket
HALF_TILES = ((64, dict(BM=64, BN=32, BK=128, num_warps=4, num_stages=4)),
              (256, dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=4)),
              (1 << 62, dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3)))
F32_TILES = ((64, dict(BM=16, BN=32, BK=32, num_warps=4)),
             (1 << 62, dict(BM=64, BN=64, BK=32, num_warps=4)))
F32_SPLIT = 256  # K per fp32 slice: a constant, so the slice sums depend on K alone
# grouped expert GEMM, by total rows T (decode-sized calls spread over more N tiles)
GROUPED_TILES = ((1024, dict(BM=64, BN=32, BK=128, num_warps=4, num_stages=4)),
                 (1 << 62, dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=3)))
FP8_BLOCK = 128  # weight scale block (rows x columns), V4's checkpoint format
FP8_TILES = ((64, dict(BM=64, BN=32)), (1 << 62, dict(BM=64, BN=128)))


def pick(table, m: int) -> dict:
    for top, t in table:
        if m <= top:
            return t
    raise ValueError(m)
