#!/bin/bash
# A/B of the serving roofline on one GPU machine: an older tree's src against this one, interleaved
# (old, new, old, new), so a change is judged on one machine and not across sessions' machines.
# Before the call, here:   mkdir -p bench/ab_old && git archive <commit> src | tar -x -C bench/ab_old
# and carry bench/ab_old (ignored by git). Both sides run this tree's bench code; OLD_COMMIT names
# the old side's commit in its result files' stamps (stamp.commit; stamp.side says which side).
# Results: $OUT/ab_{old,new}_{1,2}.json and .log.
set -o pipefail
export PYTHONUNBUFFERED=1
for i in 1 2; do
  for side in old new; do
    if [ $side = old ]; then P=$PWD/bench/ab_old/src:$PWD; C=${OLD_COMMIT:?}; else P=$PWD/src:$PWD; C=${V4STACK_COMMIT:?}; fi
    V4STACK_COMMIT=$C V4STACK_SIDE=$side PYTHONPATH=$P timeout "${AB_S:-150}" python3 -m bench.serve_roofline --device cuda \
      --configs ${CONFIGS:-flash4,flash8} --modes fast --batches ${BATCHES:-64,256} --contexts ${CONTEXTS:-1024} --steps 12 \
      --point-budget-s 4 --out $OUT/ab_${side}_$i.json > $OUT/ab_${side}_$i.log 2>&1
    echo "== $side $i"; grep -E "^flash" $OUT/ab_${side}_$i.log
  done
done
