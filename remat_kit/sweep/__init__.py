"""Sweep remat policies over a grid of presets, analysing every point, fanned out over processes,
GPUs, Ray or a SLURM array (``remat-kit analyze``'s grids run on it).

A :class:`SweepConfig` is one or more :class:`Grid` s, each the product of presets (with
``overrides``), policies, batch sizes, sequence lengths, group sizes and targets. For every
point (:class:`Point`) :func:`run_sweep`

1. analyses the step with :func:`remat_kit.memory.analyze_policies` (the compiled peak, residuals
   by checkpoint name, compiled FLOPs), all policies of one model/shape/target together;
2. where the grid measures, hands the point to the run's measurer (``experiments/measured``:
   the step timed on real text, tokens per second, MFU, measured peak, every loss);
3. appends the row to a JSONL file (:mod:`remat_kit.sweep.results`) as its task finishes.

A failed point becomes an ``oom`` / ``error`` row; ``resume=True`` skips points already in the
file. Timing and where each part lives: docs/sweep.md.

Example::

    from remat_kit.sweep import Grid, SweepConfig, run_sweep

    cfg = SweepConfig("mine", grids=(Grid("analysis", models=("tiny-gpt",),
                      policies=("no-remat", "save-nothing"), seq_lens=(64,)),))
    run = run_sweep(cfg, "out/sweep.jsonl")
    print(run.rows[0]["peak_bytes"], run.rows[0]["predicted_step_time_s"])
"""

from remat_kit.sweep.config import ALL_POLICIES as ALL_POLICIES
from remat_kit.sweep.config import Grid as Grid
from remat_kit.sweep.config import Point as Point
from remat_kit.sweep.config import SweepConfig as SweepConfig
from remat_kit.sweep.config import load_config as load_config
from remat_kit.sweep.config import validate as validate
from remat_kit.sweep.output import SweepRun as SweepRun
from remat_kit.sweep.run import run_sweep as run_sweep

__all__ = [
    "ALL_POLICIES",
    "Grid",
    "Point",
    "SweepConfig",
    "SweepRun",
    "load_config",
    "run_sweep",
    "validate",
]

#: Names that moved to the measuring harness (``experiments/measured/`` of a clone).
_MOVED = frozenset({"run_program_sweep", "measure"})


def __getattr__(name: str):
    """Say where a moved name went (PEP 562), instead of a bare "cannot import name"."""
    if name in _MOVED:
        new = "from measured import run_program_sweep" if name != "measure" else (
            "from measured import steps")  # fmt: skip
        raise ImportError(
            f"remat_kit.sweep.{name} moved out of the library to the measuring harness "
            f"(experiments/measured/): from a clone of remat-kit, with experiments/ on sys.path, "
            f"`{new}`; or run `python experiments/sweep.py --model FILE.py:FACTORY`"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
