"""Checkpoint I/O for :func:`trainer.train` (orbax ``CheckpointManager``; *not*
gradient checkpointing, which is remat).

Checkpoint ``k`` (folder ``workdir/checkpoints/<k>``) holds the state after ``k`` updates: the
:class:`~remat_kit.training.TrainState`, the run's PRNG key, and JSON metadata (the config, a
compatibility fingerprint, the data position, the loss history).

Killed saves. orbax writes ``<k>.orbax-checkpoint-tmp`` and renames it to ``<k>`` once every
item is written, and deletes checkpoints beyond ``keep`` only after that rename, so a kill leaves
the earlier checkpoints intact and a tmp folder behind. The run that writes next removes the tmp
folders *before* it opens its manager, synchronously, on the primary process, with a barrier
after it (:func:`open_for_writing`). orbax's own ``cleanup_tmp_directories=True`` instead starts
the removal in a background thread when a manager is created, waits for it only in the first
``save()``, and not in ``close()``: a manager that was closed without saving (reading the latest
step, a resume that found the run complete) left its thread deleting, and the next manager's
thread deleted the same tree at the same time; one of them failed with ``FileNotFoundError:
... 'process_0'``, raised from the next ``save()`` (orbax-checkpoint 0.12.8,
``CheckpointManager._maybe_await_cleanup_tmp_directory``). Managers that only read open
``read_only`` and delete nothing.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh

from remat_kit.training.step import TrainState, abstract_train_state, sharded_train_state

from .compiled import optimizer_for
from .config import RESUME_MAY_CHANGE, TrainConfig
from .data import Corpus
from .faults import KillAt

if TYPE_CHECKING:
    import orbax.checkpoint as ocp


def _orbax() -> Any:
    """``orbax.checkpoint``, imported where a checkpoint is read or written: a script that
    imports the trainer for less (``experiments/sweep.py``: its process helpers) does not pay
    for it."""
    import orbax.checkpoint

    return orbax.checkpoint


CHECKPOINT_DIR = "checkpoints"
"""Sub-folder of the workdir that holds the orbax checkpoints (one folder per saved step)."""

FORMAT = 1
"""Version of the checkpoint metadata layout."""


def checkpoint_dir(workdir: str | os.PathLike[str]) -> Path:
    """``workdir/checkpoints``."""
    return Path(workdir).expanduser() / CHECKPOINT_DIR


def remove_unfinished_saves(directory: Path) -> list[str]:
    """Delete the ``<k>.orbax-checkpoint-tmp`` folders killed saves left in ``directory`` (on
    the primary process; every process waits at a barrier until it is done).

    Returns:
      The names of the folders removed (empty on other processes).
    """
    ocp = _orbax()
    removed = []
    if jax.process_index() == 0 and directory.is_dir():
        for tmp in ocp.path.step.all_temporary_paths(directory):
            path = tmp.get()
            path.rmtree()
            removed.append(path.name)
    ocp.multihost.sync_global_processes("remat_kit_remove_unfinished_saves")
    return removed


def open_for_writing(
    directory: Path, keep: int, kill_at: KillAt | None = None
) -> ocp.CheckpointManager:
    """The manager a training run saves with: unfinished saves removed first (see the module
    docstring), the last ``keep`` checkpoints kept, synchronous saves."""
    ocp = _orbax()
    remove_unfinished_saves(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=True,
        cleanup_tmp_directories=False,  # done above, before the manager exists
        # Synchronous: save() returns once the checkpoint is renamed into place. The train step
        # donates the state's buffers, and on CPU a host "copy" may alias them.
        enable_async_checkpointing=False,
        temporary_path_class=None if kill_at is None else kill_at.temporary_path_class(),
    )
    return ocp.CheckpointManager(directory.resolve(), options=options)


def open_for_reading(directory: Path) -> ocp.CheckpointManager:
    """A manager that restores and lists steps, and never deletes or writes anything."""
    ocp = _orbax()
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    return ocp.CheckpointManager(directory.resolve(), options=options)


def save(mgr, step: int, state: TrainState, rng_data: np.ndarray, meta: dict[str, Any]) -> None:
    """Save checkpoint ``step``: the state, the run's key (uint32[2]) and the JSON ``meta``."""
    ocp = _orbax()
    mgr.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave({"train_state": state, "rng": rng_data}),
            meta=ocp.args.JsonSave(meta),
        ),
    )


def restore_meta(mgr: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The JSON metadata of checkpoint ``step``."""
    ocp = _orbax()
    return mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def restore(
    mgr: ocp.CheckpointManager, step: int, mesh: Mesh | None
) -> tuple[TrainState, dict[str, Any]]:
    """Checkpoint ``step``: the state (on ``mesh``, sharded as the train step takes it; None:
    the default device) and the metadata, with the run's key as ``meta["rng"]``."""
    ocp = _orbax()
    meta = restore_meta(mgr, step)
    cfg = TrainConfig.from_dict(meta["config"])
    if mesh is None:
        # Shapes with the default device's sharding: without one, orbax restores onto the
        # devices the checkpoint was saved from (a 2-process run's are not all here).
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
            abstract_train_state(cfg.model_config(), optimizer_for(cfg)),
        )
    else:
        state = sharded_train_state(cfg.model_config(), optimizer_for(cfg), mesh)[0]
    # The run's key is a host (numpy) array: every process holds it whole.
    target = {"train_state": state, "rng": np.zeros((2,), np.uint32)}
    out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    meta["rng"] = np.asarray(out["state"]["rng"]).tolist()
    return out["state"]["train_state"], meta


def compat(cfg: TrainConfig, corpus: Corpus) -> dict[str, Any]:
    """The fields a resumed run must share with its checkpoint (see RESUME_MAY_CHANGE)."""
    model = dataclasses.asdict(cfg.model_config())
    model.pop("remat_policy")
    model["preset"] = model.pop("name")
    run = {
        k: v
        for k, v in cfg.to_dict().items()
        if k not in RESUME_MAY_CHANGE and k not in ("preset", "overrides", "data", "max_bytes")
    }
    data = {"data_fingerprint": corpus.fingerprint, "data_train_tokens": int(corpus.train.size)}
    return {**model, **run, **data}


def check_compatible(saved: Mapping[str, Any], now: Mapping[str, Any], where: str) -> None:
    """Raise unless the checkpoint's :func:`compat` fields equal the run's.

    Raises:
      ValueError: one line naming every mismatched field, checkpoint vs now.
    """
    bad = [
        f"{k} (checkpoint {saved.get(k)!r}, now {now.get(k)!r})"
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k)
    ]
    if bad:
        raise ValueError(
            f"cannot resume from {where}: incompatible config, mismatched {'; '.join(bad)}; "
            "resume with the checkpoint's settings or use a fresh workdir"
        )


def latest_checkpoint_step(workdir: str | os.PathLike[str]) -> int | None:
    """The latest *complete* checkpoint step under ``workdir`` (None if there is none)."""
    directory = checkpoint_dir(workdir)
    if not directory.is_dir():
        return None
    with open_for_reading(directory) as mgr:
        return mgr.latest_step()


def load_checkpoint(
    workdir: str | os.PathLike[str], step: int | None = None, mesh: Mesh | None = None
) -> tuple[TrainState, dict[str, Any]]:
    """Restore a checkpoint written by :func:`trainer.train`.

    Args:
      workdir: the run's workdir (checkpoints are in ``workdir/checkpoints``).
      step: the checkpoint step (updates done); None for the latest complete one.
      mesh: restore the state sharded over this (dp, fsdp, tp) mesh (any mesh: a checkpoint
        does not depend on the mesh it was saved from); None: onto the default device.

    Returns:
      ``(state, meta)``: the :class:`~remat_kit.training.TrainState` with real arrays, and the
      JSON metadata (``config``, ``compat``, ``data``, ``losses``, ``val_losses``, ``rng``,
      ``step``).

    Raises:
      ValueError: no complete checkpoint (at ``step``) under ``workdir``.
    """
    directory = checkpoint_dir(workdir)
    if not directory.is_dir():
        raise ValueError(f"no complete checkpoint in {directory}: the folder does not exist")
    with open_for_reading(directory) as mgr:
        step = mgr.latest_step() if step is None else step
        if step is None or step not in mgr.all_steps():
            raise ValueError(
                f"no complete checkpoint {'' if step is None else step} in {directory}; "
                f"available: {sorted(mgr.all_steps())}"
            )
        return restore(mgr, step, mesh)
