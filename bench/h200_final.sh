#!/bin/bash
# One H200 call that re-measures the kernels and the serving engine on the committed tree (run from
# the repo root with PYTHONPATH, V4STACK_COMMIT and V4STACK_DIRTY set; $OUT on the device):
#   1. the full ops check (launch tax, invariance M = 1..4096, invariant vs fast timings, the
#      4-layer Flash whole-model check) -> $OUT/ops/
#   2. the fast-mode picks re-derived from that measurement -> $OUT/fast_picks.json, installed in
#      this copy of the tree (so what follows runs a tree that differs from the commit by exactly
#      that file: V4STACK_DIRTY=1 is set for it)
#   3. the GPU tests of ops and serving
#   4. the serving roofline (both configs, both modes, batch 1..256, 1k and 16k contexts)
# Each step writes under $OUT as it goes; a step that runs out of time leaves the others' files.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/ops"
timeout "${OPS_S:-240}" python3 -m bench.ops_gpu_check --out-dir "$OUT/ops" --model-preset flash \
    --model-set num_hidden_layers=4 --model-set 'compress_ratios=[0,0,4,128]' --model-set n_routed_experts=8 \
    --model-set num_nextn_predict_layers=0 --model-prompts 8 --model-out model_invariance_flash4_h200.json \
    2>&1 | tee "$OUT/ops_gpu_check.log"
if [ -s "$OUT/ops/ops_h200.json" ]; then
    python3 -m bench.fast_picks --source "$OUT/ops/ops_h200.json" --out "$OUT/fast_picks.json" 2>&1 | tail -5
    cp "$OUT/fast_picks.json" src/v4stack/kernels/fast_picks.json && export V4STACK_DIRTY=1
fi
timeout "${TESTS_S:-90}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops tests/serve/test_graphs_gpu.py \
    tests/serve/test_sampling.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
timeout "${SERVE_S:-200}" python3 -m bench.serve_roofline --device cuda --steps 8 --point-budget-s 4 \
    --out "$OUT/serve_engine_h200.json" 2>&1 | tail -60 | tee "$OUT/serve_roofline.log"
