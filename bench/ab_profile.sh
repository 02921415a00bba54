#!/bin/bash
# A/B of the decode step's kernels on one GPU machine: an older tree's src against this one, profiled
# in turn (old, new per round), so a change's per-kernel device time is judged on one machine.
# Before the call, here:   mkdir -p bench/ab_old && git archive <commit> src | tar -x -C bench/ab_old
# and carry bench/ab_old (ignored by git). Both sides run this tree's bench code; OLD_COMMIT names the
# old side's commit in its stamps (V4STACK_COMMIT the new side's). Results: $OUT/prof_{old,new}_<round>.json
# and .log; each round prints the step line and the per-kernel totals that differ by more than 1 us.
set -o pipefail
export PYTHONUNBUFFERED=1
ARGS=${PROFILE_ARGS:-"--configs flash4 --modes fast --batches 256 --contexts 16384 --steps 4 --warmup 4"}
for i in $(seq 1 "${ROUNDS:-1}"); do
  for side in old new; do
    if [ $side = old ]; then P=$PWD/bench/ab_old/src:$PWD; C=${OLD_COMMIT:?}; else P=$PWD/src:$PWD; C=${V4STACK_COMMIT:?}; fi
    V4STACK_COMMIT=$C V4STACK_SIDE=$side PYTHONPATH=$P timeout "${PROF_S:-150}" python3 -m bench.serve_profile --device cuda \
      $ARGS --out "$OUT/prof_${side}_$i.json" > "$OUT/prof_${side}_$i.log" 2>&1
    echo "== $side $i"; grep -E "^flash" "$OUT/prof_${side}_$i.log" | cut -c1-250
  done
  python3 - "$OUT/prof_old_$i.json" "$OUT/prof_new_$i.json" <<'PY'
import json, sys
def kernels(path):
    out = {}
    try:
        for p in json.load(open(path))["points"]:
            for k in p["step"]["top_kernels"]:
                key = (p["mode"], p["batch"], p["context"], k["name"][:60])
                out[key] = out.get(key, 0.0) + k["device_us"]
    except (OSError, KeyError, ValueError) as e:
        print("no profile:", path, e)
    return out
old, new = kernels(sys.argv[1]), kernels(sys.argv[2])
for key in sorted(set(old) | set(new)):
    a, b = old.get(key, 0.0), new.get(key, 0.0)
    if abs(a - b) > 1.0:
        print(f"{key}: {a:8.1f} -> {b:8.1f} us")
PY
done
