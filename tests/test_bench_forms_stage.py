"""``bench/decode_gpu_run.sh``'s finish-forms stage, run on the CPU: which form the later stages get.

The stage's two GPU benches (``bench.finish_forms``, ``bench.serve_roofline``) are answered by a
stand-in ``python3`` on ``PATH`` with the numbers a case gives; every other call of ``python3`` (the
stage's picker, ``bench.ab_gain``) runs the real interpreter, so what is tested is the script: its
choice of a form from the launch times and bits, and the whole-step A/B that can veto it."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# launch times (us) at 64 / 256 rows and whether every output has form 0's bits; form 2 is the
# fastest but inexact, form 3 the fastest exact one, form 1 exact but slower than 3
FORMS = {"0": (10.0, 14.0, True), "1": (9.0, 12.0, True), "2": (8.0, 11.0, False), "3": (9.5, 11.5, True)}

STAND_IN = """#!/bin/bash
if [ "$1 $2" = "-m bench.finish_forms" ]; then
  cp "$FAKE_FORMS" "${@: -1}"; exit 0
fi
if [ "$1 $2" = "-m bench.serve_roofline" ]; then
  while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done
  p=$FAKE_BASE; [ "${V4STACK_FINISH_FORM:-0}" != 0 ] && p=$FAKE_FORM_P50
  echo "{\\"runs\\": [{\\"step_s_p50\\": $p}]}" > "$out"; echo "flash4 form ${V4STACK_FINISH_FORM:-0} $p"; exit 0
fi
exec "%s" "$@"
"""


def _stage(tmp_path, form_p50: float, ab_s: int = 20) -> tuple[str, set[str]]:
    """Run the script with only the forms stage on; the form it exports and the files it wrote."""
    stub = tmp_path / "bin"
    stub.mkdir()
    py = stub / "python3"
    py.write_text(STAND_IN % sys.executable)
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    forms = tmp_path / "forms.json"
    forms.write_text(json.dumps({"cases": [
        {"op": "finish_read_norm", "rows": rows,
         "forms": {f: {"us": t[i], "bits_equal_first": t[2]} for f, t in FORMS.items()}}
        for i, rows in enumerate((64, 256))]}))
    (tmp_path / "out").mkdir()
    work = tmp_path / "w"
    off = {k: "0" for k in ("IXAB_S", "GREEDY_S", "SELECT_S", "GAPS_S", "WIDE_S", "GL_S", "HW_S", "I8_S", "IK_S",
                            "CAP_S", "NCU_S", "PROFILE_S", "SERVE_S", "CHECK_S", "RCHECK_S", "TESTS_S", "DK_S",
                            "ROPE_S", "NORM_S")}
    env = {**os.environ, **off, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "WORK": str(work), "CARD": "h200", "FORMS_S": "20", "FORMS_AB_S": str(ab_s), "FAKE_FORMS": str(forms),
           "FAKE_BASE": "0.0025", "FAKE_FORM_P50": repr(form_p50), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    env.pop("V4STACK_FINISH_FORM", None)
    run = subprocess.run(["bash", "-c", 'source bench/decode_gpu_run.sh > /dev/null 2>&1; '
                          'echo "form=${V4STACK_FINISH_FORM:-}"'], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()[-1], {p.name for p in work.iterdir()}


def test_the_fastest_exact_form_is_taken_where_the_whole_step_gains(tmp_path):
    form, files = _stage(tmp_path, 0.0024)
    assert form == "form=3"  # form 2 is faster but not exact
    # both rounds ran form 0 and form 3 (a file named for the wrong form would not count as a round)
    assert {f"serve_env_form{v}_h200_{i}.json" for v in (0, 3) for i in (1, 2)} <= files


@pytest.mark.parametrize("p50", [0.0025, 0.0025 * (1 - 0.001)])
def test_control_a_tie_in_the_whole_step_keeps_form_0(tmp_path, p50):
    form, _ = _stage(tmp_path, p50)
    assert form == "form="


def test_without_the_ab_the_launch_times_decide(tmp_path):
    form, files = _stage(tmp_path, 0.0026, ab_s=0)  # no A/B run: the step's numbers are never asked
    assert form == "form=3"
    assert not any(f.startswith("serve_env_form") for f in files)
