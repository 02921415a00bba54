#!/bin/bash
# One H200 call for the fixed-slice GEMMs (run from the repo root with PYTHONPATH set; $OUT on
# the device): compile every candidate in parallel, sweep them (bits, then device and back-to-back
# times; the pick goes to $OUT/tiles_chosen.json), install the pick, run the GPU tests of the area,
# then the ops check (invariance M = 1..4096 and timings) of linear bf16 / fp32 and hc_mix.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/ops"
cp src/v4stack/kernels/tiles_chosen.json "$OUT/tiles_chosen.json"
timeout "${SWEEP_S:-110}" python3 -m bench.gemm_tiles --only linear_bf16,linear_fp32,hc_mix --warm 14 \
    --out "$OUT/gemm_tiles_h200.json" --choose "$OUT/tiles_chosen.json" 2>&1 | tee "$OUT/run.log"
cp "$OUT/tiles_chosen.json" src/v4stack/kernels/tiles_chosen.json
timeout "${TESTS_S:-45}" python3 -m pytest tests/ops/test_slices.py tests/ops/test_fused_ops.py -m gpu -q -x \
    -p no:cacheprovider 2>&1 | tail -25 | tee -a "$OUT/run.log"
timeout "${OPS_S:-60}" python3 -m bench.ops_gpu_check --out-dir "$OUT/ops" --cases linear_bf16,linear_fp32,hc_mix \
    --skip launch,model 2>&1 | tee -a "$OUT/run.log"
