"""The experiments' trainer: training on real text with a remat policy, validation, gradient
accumulation, orbax checkpoints and resume, fault injection, several processes.

Not part of the ``remat_kit`` library: it is the machinery behind ``experiments/train.py``,
``experiments/train_demos.py``, ``experiments/soak.py`` and ``experiments/sweep.py``, imported
as ``trainer`` with ``experiments/`` on ``sys.path`` (a script in ``experiments/`` has its own
folder there; tests insert it). It builds on what the library exports for a training step
(:mod:`remat_kit.training`: :func:`~remat_kit.training.make_train_step`,
:class:`~remat_kit.training.TrainState`); the library never imports it.

:func:`train` runs a language model (a preset, optionally scaled down) on a byte-level corpus
(the Python standard library's source by default) with the remat policy and
``remat_group_size`` of a :class:`TrainConfig`, and returns a :class:`TrainResult` (the loss at
every step, periodic validation losses, timings).

Gradient accumulation is the ``lax.scan`` over micro-batches of
:func:`remat_kit.training.grad_fn`: the global batch ``[batch_size, seq_len]`` is viewed as
``[micro_batches, batch_size // micro_batches, seq_len]`` and scanned, so one micro-batch's
activations are live at a time, the float32 gradient sum is the only extra buffer, and one call
of the compiled step is one optimizer update. ``optax.MultiSteps`` was not used: it makes every
micro-batch a separate step call (a host round trip each, an optimizer state that counts
micro-steps), so a checkpoint could fall between the micro-batches of one update and "step
``t``" would no longer name one batch.

Checkpoints (orbax ``CheckpointManager``; *not* gradient checkpointing, which is remat) are saved
under ``workdir/checkpoints/<k>`` every ``ckpt_every`` updates and at the end, keeping the last
``keep``. Checkpoint ``k`` holds the state after ``k`` updates: the ``TrainState`` (params,
optimizer state, step), the run's PRNG key, and JSON metadata (the config, a compatibility
fingerprint, the data position, the loss history). The batch of step ``t`` is
``Corpus.batcher(...).batch_at(t)``, a pure function of ``(seed, t)``, so a run resumed from
checkpoint ``k`` computes bitwise the same losses as an uninterrupted one on the same machine.

Devices: the step runs on every device of the run (``jax.devices()``; every process's devices under
``jax.distributed``, see :mod:`trainer.distributed`) on the mesh ``TrainConfig.mesh`` names
(default: data parallel). Every process computes the same initial parameters and the same global
batch from the seed and places the shards its devices own (:func:`remat_kit.targets.put_global`);
orbax saves and restores the sharded state, so a run may resume on another mesh or number of
processes.

Modules: ``config`` (:class:`TrainConfig`, :class:`TrainResult`), ``compiled`` (the bounded
caches of compiled steps; :func:`clear_caches`), ``checkpoint`` (orbax I/O), ``faults`` (kill
points), ``loop`` (:func:`train`), ``diagnostics`` (environment, accumulation check, step
memory), ``distributed`` (multi-process runs), ``data`` (the byte-level corpus and its
batches).

Faults:

* A process killed while saving leaves the previous checkpoints intact: orbax writes
  ``<k>.orbax-checkpoint-tmp`` and renames it to ``<k>`` only once everything is written, and
  deletes checkpoints beyond ``keep`` only after that rename. The next run removes leftover tmp
  folders before it opens its checkpoint manager (:mod:`trainer.checkpoint` says why not in
  orbax's background thread). ``REMAT_KIT_KILL_AT`` kills a run at a named moment, for tests
  (:mod:`trainer.faults`).
* A non-finite loss or gradient norm raises :class:`NonFiniteLossError` naming the step, before
  anything is saved: the last good checkpoint stays the latest.
* Resuming with a config that would load a different model, optimizer or data stream raises a
  one-line ``ValueError`` naming every mismatched field (see :data:`RESUME_MAY_CHANGE` for the
  fields that may change between the runs).

Example (from a clone, with ``experiments/`` on ``sys.path``)::

    from trainer import TrainConfig, train

    cfg = TrainConfig(preset="tiny-gpt", policy="save-nothing", steps=200, micro_batches=2)
    result = train(cfg, "runs/tiny")            # writes runs/tiny/checkpoints/{150,200,...}
    result = train(cfg.replace(steps=400), "runs/tiny", resume=True)   # continues from 200
"""

from . import distributed as distributed
from .checkpoint import CHECKPOINT_DIR as CHECKPOINT_DIR
from .checkpoint import latest_checkpoint_step as latest_checkpoint_step
from .checkpoint import load_checkpoint as load_checkpoint
from .compiled import clear_caches as clear_caches
from .config import RESUME_MAY_CHANGE as RESUME_MAY_CHANGE
from .config import NonFiniteLossError as NonFiniteLossError
from .config import TrainConfig as TrainConfig
from .config import TrainResult as TrainResult
from .diagnostics import compare_updates as compare_updates
from .diagnostics import environment_info as environment_info
from .diagnostics import train_step_memory as train_step_memory
from .loop import train as train

__all__ = [
    "CHECKPOINT_DIR",
    "NonFiniteLossError",
    "RESUME_MAY_CHANGE",
    "TrainConfig",
    "TrainResult",
    "clear_caches",
    "compare_updates",
    "distributed",
    "environment_info",
    "latest_checkpoint_step",
    "load_checkpoint",
    "train",
    "train_step_memory",
]
