#!/bin/bash
# One H200 call that re-measures the kernels and the serving engine on the committed tree (run from
# the repo root with PYTHONPATH, V4STACK_COMMIT and V4STACK_DIRTY set; $OUT on the device):
#   1. the full ops check (launch tax, invariance M = 1..4096, invariant vs fast timings, the
#      4-layer Flash whole-model check, with the in-place rotation's barrier-less control) -> ops/
#   2. the fast-mode picks re-derived from that measurement -> fast_picks.json, installed in
#      this copy of the tree (so what follows runs a tree that differs from the commit by exactly
#      that file: V4STACK_DIRTY=1 is set for it)
#   3. the serving roofline (both configs, both modes, batch 1..256, 1k and 16k contexts)
#   4. where a flash4 decode step's time goes (profile, b64 / b256, 1k / 16k, both modes; PROFILE_S=0 skips it)
#   5. the GPU tests (every test marked gpu that one GPU can run)
# Everything is written under $WORK (default /tmp/h200_final) and packed into $OUT/final.tgz after each
# step (the device returns only a few files).
# A step that runs out of time leaves the others' files.
set -o pipefail
export PYTHONUNBUFFERED=1
W=${WORK:-/tmp/h200_final}
mkdir -p "$W/ops" "$W/serve"
timeout "${OPS_S:-250}" python3 -m bench.ops_gpu_check --out-dir "$W/ops" --model-preset flash \
    --model-set num_hidden_layers=4 --model-set 'compress_ratios=[0,0,4,128]' --model-set n_routed_experts=8 \
    --model-set num_nextn_predict_layers=0 --model-prompts 8 --model-phases decode,invariant,fast,mixed_rope --model-out model_invariance_flash4_h200.json \
    2>&1 | tee "$W/ops_gpu_check.log"
if [ -s "$W/ops/ops_h200.json" ]; then
    python3 -m bench.fast_picks --source "$W/ops/ops_h200.json" --out "$W/fast_picks.json" 2>&1 | tail -12
    cp "$W/fast_picks.json" src/v4stack/kernels/fast_picks.json && export V4STACK_DIRTY=1
fi
pack() { tar -C "$W" -czf "$OUT/final.tgz.part" . && mv "$OUT/final.tgz.part" "$OUT/final.tgz"; }
pack  # the device returns a few files only: everything travels in one archive, refreshed after each step
timeout "${SERVE_S:-160}" python3 -m bench.serve_roofline --device cuda --steps 8 --point-budget-s 4 \
    --out "$W/serve/serve_engine_h200.json" > "$W/serve_roofline.log" 2>&1; tail -40 "$W/serve_roofline.log"
pack
[ "${PROFILE_S:-100}" != 0 ] && timeout "${PROFILE_S:-100}" python3 -m bench.serve_profile --device cuda --configs flash4 --modes fast,invariant \
    --batches 64,256 --contexts 1024,16384 --steps 4 --warmup 4 --out "$W/serve/serve_profile_h200.json" \
    > "$W/serve_profile.log" 2>&1; grep -E "^flash" "$W/serve_profile.log"
pack
# the serving, model and optimizer tests first: tests/ops ends with the slices sweep test, which compiles every tile
timeout "${TESTS_S:-80}" python3 -m pytest -m gpu -v -rfE --tb=short -p no:cacheprovider tests/serve tests/model/test_gpu.py \
    tests/optim/test_zero_gpu.py tests/ops --continue-on-collection-errors > "$W/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$W/gpu_tests.log" | tail -20
pack
