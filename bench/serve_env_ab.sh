#!/bin/bash
# A/B of environment settings on one tree's src, interleaved on one GPU machine: each round runs
# every variant once (variant 1, 2, ..., then again), so a setting is judged on one machine.
#   VARIANTS="ix0:V4STACK_INDEX_STREAM=0 ix1:V4STACK_INDEX_STREAM=1"  (name:NAME=VALUE,NAME=VALUE ...)
#   SRC   the src to run (default this tree's; an A/B tree: bench/ab_old/src, carried)
#   SRC_COMMIT  its commit (the result files' stamp.commit; the setting is in stamp.env)
# Both sides run this tree's bench code. Results: $OUT/env_<name>_<round>.json and .log.
set -o pipefail
export PYTHONUNBUFFERED=1
SRC=${SRC:-$PWD/src}
for i in $(seq 1 "${ROUNDS:-2}"); do
  for v in ${VARIANTS:?}; do
    name=${v%%:*}
    sets=${v#*:}
    env_args=()
    IFS=, read -ra kv <<< "$sets"
    for a in "${kv[@]}"; do env_args+=("$a"); done
    env "${env_args[@]}" V4STACK_COMMIT=${SRC_COMMIT:?} PYTHONPATH=$SRC:$PWD timeout "${AB_S:-60}" python3 -m bench.serve_roofline \
      --device cuda --configs ${CONFIGS:-flash4} --modes ${MODES:-fast} --batches ${BATCHES:-256} --contexts ${CONTEXTS:-16384} \
      --steps ${STEPS:-32} --point-budget-s 4 --out "$OUT/env_${name}_$i.json" > "$OUT/env_${name}_$i.log" 2>&1
    echo "== $name $i"; grep -E "^flash" "$OUT/env_${name}_$i.log"
  done
done
