"""``v4stack bench dsec``: create / first exec / snapshot / restore latency per substrate (p50, p99),
and density (idle sandboxes held, memory per sandbox), measured on the runtime an edge runs.

Anchors from the spec: crun start+stop ~5 ms, Firecracker snapshot restore ~5-8 ms, E2B create
~150 ms; the goal here is container create p50 <= 50 ms from a warm image, snapshot and restore
p50 <= 20 ms.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path

ANCHORS_MS = {"crun_start_stop": 5, "firecracker_restore": "5-8", "e2b_create": 150}
GOALS_MS = {"container_create_p50": 50, "snapshot_p50": 20, "restore_p50": 20}


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, int(round(p / 100 * (len(s) - 1)))))
    return s[k]


def _summary(xs: list[float]) -> dict:
    ms = [x * 1000 for x in xs]
    return {"n": len(ms), "p50_ms": round(_pct(ms, 50), 3), "p99_ms": round(_pct(ms, 99), 3),
            "mean_ms": round(sum(ms) / len(ms), 3) if ms else None}


def _mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _wait_pool(rt, sub: str, want: int, timeout: float = 30) -> None:
    s = rt.substrate(sub)
    if not hasattr(s, "pool"):
        return
    deadline = time.monotonic() + timeout
    while s.pool.qsize() < want and time.monotonic() < deadline:
        s._refill()  # untimed: the pool is refilled in the background between real requests
        time.sleep(0.01)


def bench_substrate(rt, sub: str, iters: int) -> dict:
    create, first, snap, restore, fork = [], [], [], [], []
    for _ in range(iters):
        _wait_pool(rt, sub, 1)
        t0 = time.perf_counter()
        s = rt.create("busybox", sub)
        t1 = time.perf_counter()
        s.exec("echo hi > /workspace/f")
        t2 = time.perf_counter()
        d = s.snapshot()
        t3 = time.perf_counter()
        s.exec("rm /workspace/f; echo x > /workspace/g")
        t4 = time.perf_counter()
        s.restore(d["id"])
        t5 = time.perf_counter()
        _wait_pool(rt, sub, 1)
        t6 = time.perf_counter()
        f = rt.create(substrate=sub, snapshot=d["id"])
        t7 = time.perf_counter()
        create.append(t1 - t0)
        first.append(t2 - t1)
        snap.append(t3 - t2)
        restore.append(t5 - t4)
        fork.append(t7 - t6)
        rt.kill(f.id)
        rt.kill(s.id)
    return {"create": _summary(create), "first_exec": _summary(first),
            "create_plus_first_exec": _summary([a + b for a, b in zip(create, first)]), "snapshot": _summary(snap),
            "restore": _summary(restore), "fork_from_snapshot": _summary(fork)}


def bench_density(rt, sub: str, n: int) -> dict:
    """Hold ``n`` idle sandboxes (each after one command) and see what they cost."""
    _wait_pool(rt, sub, 1)
    before = _mem_available()
    t0 = time.perf_counter()
    held = []
    try:
        for _ in range(n):
            s = rt.create("busybox", sub)
            s.exec("echo ready > /workspace/ready")
            held.append(s)
        elapsed = time.perf_counter() - t0
        time.sleep(0.5)
        used = max(0, before - _mem_available())
        cg = sum(s.handle.cgroup.memory_usage() for s in held if s.handle.cgroup)
        per = max(used, cg) / len(held)  # MemAvailable moves with everything else on the host too
        try:
            mount_max = int(Path("/proc/sys/fs/mount-max").read_text())
        except (OSError, ValueError):
            mount_max = 100_000
        by_mem = int(before // per) if per > 0 else None
        by_mounts = mount_max // 2  # a tmpfs upper and an overlay root per sandbox
        return {"sandboxes": len(held), "seconds_to_fill": round(elapsed, 3),
                "host_mem_per_sandbox_mib": round(per / 2**20, 3),
                "cgroup_mem_per_sandbox_mib": round(cg / len(held) / 2**20, 3),
                "mem_available_before_mib": round(before / 2**20, 1),
                "fit_by_memory": by_mem, "fit_by_mount_limit": by_mounts,
                "estimated_idle_fit": min(x for x in (by_mem, by_mounts) if x is not None)}
    finally:
        for s in held:
            rt.kill(s.id)


def bench_dsec(out: str | None = "bench/results/dsec.json", iters: int = 30, density: int = 64,
               substrates: tuple[str, ...] = ("process", "container"), home: str | None = None) -> dict:
    """Run the dsec benchmark; writes JSON to ``out`` (temp + rename) and returns the result."""
    from bench.runner import write_result
    from v4stack.dsec.runtime import Runtime

    if iters < 1 or density < 1:
        raise ValueError(f"iters={iters}, density={density}: both must be >= 1")
    tmp = None
    if home is None:
        tmp = tempfile.mkdtemp(prefix="dsec-bench-")
        home = tmp
    rt = Runtime(home, pool_size=4)
    try:
        t = time.perf_counter()
        rt.images.build("busybox")
        image_build = time.perf_counter() - t
        result = {"bench": "dsec", "host": {"cpus": os.cpu_count(), "kernel": platform.release(),
                                            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]},
                  "iters": iters, "image_build_s": round(image_build, 3), "anchors_ms": ANCHORS_MS,
                  "goals_ms": GOALS_MS, "substrates": {}}
        for sub in substrates:
            rt.substrate(sub)
            _wait_pool(rt, sub, 4)
            bench_substrate(rt, sub, 3)  # warm-up
            r = bench_substrate(rt, sub, iters)
            r["density"] = bench_density(rt, sub, density)
            result["substrates"][sub] = r
    finally:
        rt.close()
        if tmp:
            import shutil

            if _unmount_under(tmp):  # never delete through a mount that is still there
                shutil.rmtree(tmp, ignore_errors=True)
    if out:
        write_result(out, result)
    return result


def _unmount_under(home: str) -> bool:
    """Unmount everything under ``home``; True once nothing is mounted there."""
    from v4stack.dsec.mounts import umount

    prefix = home.rstrip("/") + "/"
    for _ in range(5):
        with open("/proc/self/mountinfo") as f:
            pts = sorted({ln.split()[4] for ln in f if ln.split()[4].startswith(prefix)}, key=len, reverse=True)
        if not pts:
            return True
        for p in pts:
            try:
                umount(p)
            except OSError:
                pass
    return False


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="bench dsec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30, help="repetitions per measured verb and substrate")
    ap.add_argument("--density", type=int, default=64, help="idle sandboxes for the density measurement")
    ap.add_argument("--out", default="bench/results/dsec.json")
    a = ap.parse_args(argv)
    r = bench_dsec(out=a.out, iters=a.iters, density=a.density)
    for sub, v in r["substrates"].items():
        print(sub, {k: (x["p50_ms"], x["p99_ms"]) for k, x in v.items() if "p50_ms" in x}, v["density"])
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
