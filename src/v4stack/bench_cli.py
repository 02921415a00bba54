"""``v4stack bench NAME [ARGS]``: runs ``bench/NAME.py``'s ``main(ARGS)`` from the source checkout.

The benchmarks are not part of the library: they live in the repository's top-level ``bench``
package, each module with an argparse ``main(argv)`` that owns its options and defaults, so
``v4stack bench ops --device cuda`` and ``python -m bench.ops --device cuda`` are the same run.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[2]
# the names users type -> modules of the bench package
BENCHES = {
    "ops": "ops", "ops-check": "ops_check", "serve": "serve", "serve-engine": "serve_engine", "serve-roofline": "serve_roofline",
    "megamoe": "megamoe", "megamoe-compute": "megamoe_compute", "dsec": "dsec", "wal": "rollout_wal",
    "prefix": "prefix", "train-tiny": "train_tiny", "muon-vs-adamw": "muon_vs_adamw",
    "muon-plan-table": "muon_plan_table", "journal-ab": "journal_ab", "pp-bubble": "pp_bubble",
    "grad-chunks": "grad_chunks",
}

app = typer.Typer(help="Benchmarks that write stamped JSON under bench/results/ (run from a source checkout).",
                  no_args_is_help=True)


def _module(name: str):
    if not (ROOT / "bench" / "runner.py").is_file():
        raise typer.BadParameter(f"no bench/ package next to {ROOT / 'src'}: benchmarks run from a source checkout")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"bench.{name}")


def _register(name: str, module: str) -> None:
    @app.command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                         "help_option_names": []},
                 help=f"python -m bench.{module} (pass --help for its options)")
    def _run(ctx: typer.Context) -> None:
        _module(module).main(list(ctx.args))


for _name, _mod in BENCHES.items():
    _register(_name, _mod)
