#!/bin/bash
# One H200 call for the fixed-slice GEMMs (run from the repo root with PYTHONPATH set; $OUT on
# the device): compile every candidate in parallel (hc_mix's too, for the GPU tests), sweep them
# (bits, then device and back-to-back times; fp32 at the router's decode sizes only, the other
# buckets keep their tiles; the pick goes to $OUT/tiles_chosen.json), install the pick, then run
# the GPU tests of the area. The ops check (``bench.ops_gpu_check``) is a separate, later call.
set -o pipefail
export PYTHONUNBUFFERED=1
cp src/v4stack/kernels/tiles_chosen.json "$OUT/tiles_chosen.json"
timeout "${SWEEP_S:-52}" python3 -m bench.gemm_tiles --only linear_fp32,linear_bf16 --ms linear_fp32=1,8 \
    --warm 15 --warm-also hc_mix --target-s 0.01 \
    --out "$OUT/gemm_tiles2_h200.json" --choose "$OUT/tiles_chosen.json" 2>&1 | tee "$OUT/run.log"
cp "$OUT/tiles_chosen.json" src/v4stack/kernels/tiles_chosen.json
timeout "${TESTS_S:-30}" python3 -m pytest tests/ops/test_slices.py tests/ops/test_fused_ops.py -m gpu -q -x \
    -p no:cacheprovider 2>&1 | tail -25 | tee -a "$OUT/run.log"
