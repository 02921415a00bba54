#!/bin/bash
# One H200 call for the serving kernels (run from the repo root with PYTHONPATH, V4STACK_COMMIT and
# V4STACK_DIRTY set; $OUT on the device), each step under its own time cap, everything packed into
# $OUT/serve_run.tgz after each step (the device returns a few files only):
#   1. the sparse attention's launch-shape sweep (bits classes, device times) and its GPU test;
#      the pick is installed in this copy of the tree before the later steps
#   2. the grouped expert GEMM's tile sweep at the serving calls (9 / 65 experts with the joined
#      shared expert, gate / up separate and as one N = 4096 call, down; 1-256 decode tokens)
#   3. where a flash4 decode step's time goes
#   4. a few serving roofline points (flash4 b64 / b256 1k, flash8 b256 16k; fast mode)
set -o pipefail
export PYTHONUNBUFFERED=1
W=${WORK:-/tmp/serve_run}
mkdir -p "$W"
pack() { tar -C "$W" -czf "$OUT/serve_run.tgz.part" . && mv "$OUT/serve_run.tgz.part" "$OUT/serve_run.tgz"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv > "$W/gpu.txt" 2>&1
timeout "${ATTN_S:-110}" python3 -m bench.attention_tiles --out "$W/attention_tiles_h200.json" \
    --choose "$W/attention_tiles.json" --warm 13 --pytest tests/ops/test_attention_gpu.py > "$W/attention.log" 2>&1
tail -25 "$W/attention.log"
[ -s "$W/attention_tiles.json" ] && cp "$W/attention_tiles.json" src/v4stack/kernels/attention_tiles.json \
    && export V4STACK_DIRTY=1
pack
timeout "${GROUPED_S:-110}" python3 -m bench.grouped_tiles --warm 14 --serving --experts 9,65 --tokens 64,256,16,1 \
    --out "$W/grouped_serving_h200.json" > "$W/grouped.log" 2>&1
grep -E "^grouped" "$W/grouped.log"
pack
timeout "${PROFILE_S:-90}" python3 -m bench.serve_profile --device cuda --configs flash4 --modes fast \
    --batches 64,256 --contexts 1024 --steps 4 --warmup 4 --out "$W/serve_profile_h200.json" \
    > "$W/serve_profile.log" 2>&1; grep -E "^flash|Error" "$W/serve_profile.log"
pack
timeout "${SERVE_S:-80}" python3 -m bench.serve_roofline --device cuda --configs flash4 --modes fast,invariant \
    --batches 64,256 --contexts 1024 --steps 8 --point-budget-s 4 --out "$W/serve_engine_points_h200.json" \
    > "$W/serve_roofline.log" 2>&1; tail -12 "$W/serve_roofline.log"
pack
