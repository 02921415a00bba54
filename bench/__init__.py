"""Benchmarks. Each module has ``main(argv)``; run one as ``python -m bench.NAME`` from the repository
root or as ``v4stack bench NAME``. Results go through ``bench.runner.write_result`` (stamped JSON)."""
