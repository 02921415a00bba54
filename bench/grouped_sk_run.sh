#!/bin/bash
# One GPU call for the grouped GEMMs of kernels/triton_grouped_sk.py and triton_grouped_tma.group_linear_tma:
# their GPU tests, bench/grouped_sk.py, and the flash4 batch-256 decode step with them and without
# (V4STACK_GROUPED_SK_ROWS=0 V4STACK_GROUP_TMA=0), two interleaved runs of each. Run from the repo root
# with PYTHONPATH, V4STACK_COMMIT and V4STACK_DIRTY set; results under $OUT/sk (packed as sk.tgz).
export PYTHONUNBUFFERED=1
W=${WORK:-/tmp/sk_run}
CARD=${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -qi h100 && echo h100 || echo h200)}
mkdir -p "$W"
pack() { tar -C "$W" -czf "$OUT/sk.tgz.part" . && mv "$OUT/sk.tgz.part" "$OUT/sk.tgz"; }
timeout "${TESTS_S:-150}" python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider tests/ops/test_grouped_sk.py \
    tests/ops/test_fused_ops.py tests/ops/test_grouped_linear.py > "$W/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$W/gpu_tests.log" | tail -12
timeout "${BENCH_S:-150}" python3 -m bench.grouped_sk --out "$W/grouped_sk_${CARD}.json" > "$W/grouped_sk.log" 2>&1
grep -E "'us'|error" "$W/grouped_sk.log" | sed -E "s/'experts_rows': \[[^]]*\], //" | cut -c1-330
pack
for i in ${RUNS:-1 2}; do
  for side in new old; do
    env $([ $side = old ] && echo V4STACK_GROUPED_SK_ROWS=0 V4STACK_GROUP_TMA=0) timeout "${SERVE_S:-100}" \
      python3 -m bench.serve_roofline --device cuda --configs flash4 --modes ${MODES:-fast,invariant} \
      --batches ${BATCHES:-256} --contexts ${CONTEXTS:-1024,16384} --steps ${STEPS:-24} --point-budget-s 4 \
      --out "$W/serve_sk_${side}_${CARD}_$i.json" > "$W/serve_${side}_$i.log" 2>&1
    grep -E "^flash" "$W/serve_${side}_$i.log" | sed "s/^/$side $i /" | cut -c1-150
    pack
  done
done
