"""Sweep remat policies over a grid; analyse every point, measure the ones on the local device.

A :class:`SweepConfig` is one or more :class:`Grid` s, each the product

    model presets x policies x batch sizes x sequence lengths x remat_group_size x targets

(with ModelConfig ``overrides`` applied to every model, e.g. ``scan_layers=True``). For every
point (:class:`Point`) :func:`run_sweep`

1. analyses the step with :func:`remat_kit.memory.analyze_policies` (the compiled peak, residuals
   by checkpoint name, compiled FLOPs), all policies of one model/shape/target together;
2. when the target is the local device and the grid asks for it, runs the real training step
   (optax AdamW, train state donated) on real text: ``warmup_steps`` untimed then
   ``timed_steps`` timed steps, each ended by ``jax.block_until_ready``; records the median step
   time, tokens per second, model FLOPs utilisation where the device's peak FLOP/s is known, the
   measured peak memory (``memory_stats()["peak_bytes_in_use"]`` where the backend gives it,
   ``None`` otherwise: the CPU backend gives none) and every loss;
3. appends the row to a JSONL file (:mod:`remat_kit.sweep.results`) as soon as the point's task
   finishes, in whatever order tasks finish (one write, flushed and fsync-ed: a kill leaves
   whole rows and at most a torn last line, which a resume drops); a row's figures, the resume
   and the summary do not depend on that order.

Where the code lives: ``config`` (Grid, SweepConfig, Point, config files), ``checks`` (grid
validation, failure wording), ``measure`` (the step's executable, its arguments placed, its
steps timed; model FLOPs), ``rows`` (one row per point), ``output`` (the results file, resume,
progress), ``tasks`` (points as tasks: a group's points run together, keyed by their rows'
keys; progress over tasks), ``engine`` (what runs the tasks: this process, one after the other;
or side by side, analysis-only tasks on CPU worker processes and each measured point on its own
GPU(s): :func:`~remat_kit.sweep.engine.local_engine`), ``worker`` (a worker process's loop),
``ray_engine`` (tasks as Ray tasks, ``pip install 'remat-kit[ray]'``), ``shard`` (the i-th of N
parts of the points, each in its own part file, and their merge: SLURM job arrays), ``fanout``
(the engine, shard and merge flags a command line takes, checked together: ``experiments/
sweep.py`` and ``remat-kit analyze``'s grid), ``run``
(the one loop, for a grid of presets and for a user's own
:class:`~remat_kit.program.Program`: :func:`run_program_sweep`). Steps compile through
:class:`remat_kit.memory.runner.CompileEngine`: a measured point's step is the program the
analysis compiled, so it is compiled once (one device); on a mesh the run fixes its output
shardings and compiles its own.

A failure at one point (out of memory, compile error, anything raised) becomes a row with status
``oom`` or ``error`` and the message; the sweep goes on. ``resume=True`` skips points whose
key is already in the file, so a killed sweep loses at most the point in progress.

Model FLOPs follow PaLM (Chowdhery et al. 2022, arXiv:2204.02311, appendix B): per token
``6 N + 12 L H Q T`` (N parameters used in matmuls, L layers, H heads, Q head dimension, T
sequence length); recomputation is not counted, so a remat policy lowers the MFU it reaches.

Example::

    from remat_kit.sweep import Grid, SweepConfig, run_sweep

    cfg = SweepConfig("mine", grids=(Grid("measured", models=("tiny-gpt",),
                      policies=("no-remat", "save-nothing"), seq_lens=(64,)),))
    run = run_sweep(cfg, "out/sweep.jsonl")
    print(run.rows[0]["peak_bytes"], run.rows[0]["step_time_s"])
"""

from remat_kit.sweep.config import ALL_POLICIES as ALL_POLICIES
from remat_kit.sweep.config import Grid as Grid
from remat_kit.sweep.config import Point as Point
from remat_kit.sweep.config import SweepConfig as SweepConfig
from remat_kit.sweep.config import load_config as load_config
from remat_kit.sweep.config import validate as validate
from remat_kit.sweep.measure import model_flops_per_token as model_flops_per_token
from remat_kit.sweep.output import SweepRun as SweepRun
from remat_kit.sweep.run import run_program_sweep as run_program_sweep
from remat_kit.sweep.run import run_sweep as run_sweep

__all__ = [
    "ALL_POLICIES",
    "Grid",
    "Point",
    "SweepConfig",
    "SweepRun",
    "load_config",
    "model_flops_per_token",
    "run_program_sweep",
    "run_sweep",
    "validate",
]
