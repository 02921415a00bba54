"""The `v4stack` command as a user runs it (subprocesses)."""

import json
import subprocess
import sys

import pytest

V4 = [sys.executable, "-m", "v4stack.cli"]


def run(*args, check=True):
    return subprocess.run(V4 + list(args), capture_output=True, text=True, check=check, timeout=300)


@pytest.mark.parametrize("preset,total,active", [("flash", 284e9, 13e9), ("pro", 1.6e12, 49e9)])
def test_info_counts_within_3_percent(preset, total, active):
    out = json.loads(run("info", "--preset", preset, "--json").stdout)
    assert abs(out["total_params"] / total - 1) < 0.03, out["total_params"]
    assert abs(out["active_params"] / active - 1) < 0.03, out["active_params"]
    assert out["cache_bytes_per_token"]["compressed_kv_csa"] > 0


def test_flash_v4_format_cache_is_about_3_9_kb_per_token():
    out = json.loads(run("info", "--preset", "flash", "--json").stdout)
    assert 3700 < out["cache_bytes_per_token_v4_format"]["total"] < 4100


def test_generate_tiny_random_and_saved(tmp_path):
    from v4stack.config import preset
    from v4stack.model import V4Model
    from v4stack.model.weights import save_model

    r = run("generate", "--preset", "tiny", "--prompt", "hello", "--max-tokens", "8")
    meta = json.loads(r.stderr.strip().splitlines()[-1])
    assert meta["new_tokens"] == 8 and meta["prompt_tokens"] == 5
    save_model(V4Model(preset("tiny"), seed=0), tmp_path / "m")
    r2 = run("generate", "--model", str(tmp_path / "m"), "--prompt", "hello", "--max-tokens", "8")
    assert json.loads(r2.stderr.strip().splitlines()[-1])["token_ids"] == meta["token_ids"]


def test_bad_input_is_a_clear_error(tmp_path):
    r = run("info", "--preset", "huge", check=False)
    assert r.returncode == 2 and "unknown preset 'huge'" in r.stderr
    r = run("generate", "--model", str(tmp_path), "--prompt", "x", check=False)
    assert r.returncode != 0 and "no config.json" in r.stderr
