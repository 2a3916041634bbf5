"""Training on real text with a remat policy: validation, gradient accumulation, orbax checkpoints.

:func:`train` runs a language model (a preset, optionally scaled down) on a byte-level corpus
(:mod:`remat_kit.training.data`; the Python standard library's source by default) with the remat
policy and ``remat_group_size`` of a :class:`TrainConfig`, and returns a :class:`TrainResult` (the
loss at every step, periodic validation losses, timings).

Gradient accumulation is the ``lax.scan`` over micro-batches of :func:`grad_fn`:
the global batch ``[batch_size, seq_len]`` is viewed as ``[micro_batches, batch_size //
micro_batches, seq_len]`` and scanned, so one micro-batch's activations are live at a time, the
float32 gradient sum is the only extra buffer, and one call of the compiled step is one optimizer
update. ``optax.MultiSteps`` was not used: it makes every micro-batch a separate step call (a
host round trip each, an optimizer state that counts micro-steps), so a checkpoint could fall
between the micro-batches of one update and "step ``t``" would no longer name one batch.

Checkpoints (orbax ``CheckpointManager``; *not* gradient checkpointing, which is remat) are saved
under ``workdir/checkpoints/<k>`` every ``ckpt_every`` updates and at the end, keeping the last
``keep``. Checkpoint ``k`` holds the state after ``k`` updates: the :class:`TrainState` (params,
optimizer state, step), the run's PRNG key, and JSON metadata (the config, a compatibility
fingerprint, the data position, the loss history). The batch of step ``t`` is
``Corpus.batcher(...).batch_at(t)``, a pure function of ``(seed, t)``, so a run resumed from
checkpoint ``k`` computes bitwise the same losses as an uninterrupted one on the same machine.

Devices: the step runs on every device of the run (``jax.devices()``; every process's devices under
``jax.distributed``, see :mod:`remat_kit.training.distributed`) on the mesh ``TrainConfig.mesh``
names (default: data parallel). Every process computes the same initial parameters and the same
global batch from the seed and places the shards its devices own
(:func:`remat_kit.targets.put_global`); orbax saves and restores the sharded state, so a run may
resume on another mesh or number of processes.

Modules: ``step`` (loss, optimizer, train state, :func:`make_train_step`: what the analyzer
compiles too), ``config`` (:class:`TrainConfig`, :class:`TrainResult`), ``compiled`` (the
bounded caches of compiled steps; :func:`clear_caches`), ``checkpoint`` (orbax I/O), ``faults``
(kill points), ``loop`` (:func:`train`), ``diagnostics`` (environment, accumulation check, step
memory), ``data`` (the byte-level corpus and its batches), ``distributed`` (multi-process runs).

Faults:

* A process killed while saving leaves the previous checkpoints intact: orbax writes
  ``<k>.orbax-checkpoint-tmp`` and renames it to ``<k>`` only once everything is written, and
  deletes checkpoints beyond ``keep`` only after that rename. The next run removes leftover tmp
  folders before it opens its checkpoint manager (:mod:`remat_kit.training.checkpoint` says why
  not in orbax's background thread). ``REMAT_KIT_KILL_AT`` kills a run at a named moment, for
  tests (:mod:`remat_kit.training.faults`).
* A non-finite loss or gradient norm raises :class:`NonFiniteLossError` naming the step, before
  anything is saved: the last good checkpoint stays the latest.
* Resuming with a config that would load a different model, optimizer or data stream raises a
  one-line ``ValueError`` naming every mismatched field (see :data:`RESUME_MAY_CHANGE` for the
  fields that may change between the runs).

Example::

    from remat_kit.training import TrainConfig, train

    cfg = TrainConfig(preset="tiny-gpt", policy="save-nothing", steps=200, micro_batches=2)
    result = train(cfg, "runs/tiny")            # writes runs/tiny/checkpoints/{150,200,...}
    result = train(cfg.replace(steps=400), "runs/tiny", resume=True)   # continues from 200
"""

from remat_kit.training.checkpoint import CHECKPOINT_DIR as CHECKPOINT_DIR
from remat_kit.training.checkpoint import latest_checkpoint_step as latest_checkpoint_step
from remat_kit.training.checkpoint import load_checkpoint as load_checkpoint
from remat_kit.training.compiled import clear_caches as clear_caches
from remat_kit.training.config import RESUME_MAY_CHANGE as RESUME_MAY_CHANGE
from remat_kit.training.config import NonFiniteLossError as NonFiniteLossError
from remat_kit.training.config import TrainConfig as TrainConfig
from remat_kit.training.config import TrainResult as TrainResult
from remat_kit.training.diagnostics import compare_updates as compare_updates
from remat_kit.training.diagnostics import environment_info as environment_info
from remat_kit.training.diagnostics import train_step_memory as train_step_memory
from remat_kit.training.loop import train as train
from remat_kit.training.step import OPTIMIZERS as OPTIMIZERS
from remat_kit.training.step import Batch as Batch
from remat_kit.training.step import TrainState as TrainState
from remat_kit.training.step import abstract_batch as abstract_batch
from remat_kit.training.step import abstract_train_state as abstract_train_state
from remat_kit.training.step import check_micro_batches as check_micro_batches
from remat_kit.training.step import cross_entropy_loss as cross_entropy_loss
from remat_kit.training.step import grad_fn as grad_fn
from remat_kit.training.step import init_boxed_params as init_boxed_params
from remat_kit.training.step import init_params as init_params
from remat_kit.training.step import init_train_state as init_train_state
from remat_kit.training.step import loss_fn as loss_fn
from remat_kit.training.step import make_optimizer as make_optimizer
from remat_kit.training.step import make_train_step as make_train_step
from remat_kit.training.step import sharded_train_state as sharded_train_state

__all__ = [
    "Batch",
    "CHECKPOINT_DIR",
    "NonFiniteLossError",
    "OPTIMIZERS",
    "RESUME_MAY_CHANGE",
    "TrainConfig",
    "TrainResult",
    "TrainState",
    "abstract_batch",
    "abstract_train_state",
    "check_micro_batches",
    "clear_caches",
    "compare_updates",
    "cross_entropy_loss",
    "environment_info",
    "grad_fn",
    "init_boxed_params",
    "init_params",
    "init_train_state",
    "latest_checkpoint_step",
    "load_checkpoint",
    "loss_fn",
    "make_optimizer",
    "make_train_step",
    "sharded_train_state",
    "train",
    "train_step_memory",
]
