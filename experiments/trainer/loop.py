"""The training loop, :func:`train`: a short sequence of named stages (set up the data and mesh,
open the checkpoints, start fresh or resume, compile, run the steps, report)."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh

from remat_kit import targets as T
from remat_kit.models import ModelConfig
from remat_kit.training.step import TrainState

from .checkpoint import (
    FORMAT,
    check_compatible,
    checkpoint_dir,
    compat,
    open_for_writing,
    restore,
    restore_meta,
    save,
)
from .compiled import compiled_step, eval_fn, initial_state, opt_key
from .config import NonFiniteLossError, TrainConfig, TrainResult
from .data import Batcher, Corpus, load_corpus
from .faults import KillAt

if TYPE_CHECKING:
    import orbax.checkpoint as ocp


@dataclasses.dataclass
class _Run:
    """What a call of :func:`train` sets up before touching the checkpoints."""

    cfg: TrainConfig
    model: ModelConfig
    mesh: Mesh
    corpus: Corpus
    batcher: Batcher
    val: list[tuple[jax.Array, jax.Array]]  # validation batches, placed on the mesh
    compat: dict[str, Any]
    directory: Path
    kill_at: KillAt | None


@dataclasses.dataclass
class _Progress:
    """The run's state between steps: what a checkpoint holds."""

    state: TrainState
    rng_data: np.ndarray  # uint32[2], the run's key on the host
    losses: list[float]
    val_losses: list[tuple[int, float]]
    start: int  # updates done when this call started
    resumed_from: int | None


def _set_up(cfg: TrainConfig, workdir: str | os.PathLike[str]) -> _Run:
    mesh = T.local_mesh(cfg.mesh)
    T.check_batch(cfg.batch_size, mesh, cfg.micro_batches)
    batch_sharding = T.batch_sharding(mesh)
    corpus = load_corpus(cfg.data, max_bytes=cfg.max_bytes, val_fraction=cfg.val_fraction)
    val = []
    if cfg.eval_every:
        val = [
            T.put_global(xy, (batch_sharding, batch_sharding))
            for xy in corpus.val_batches(cfg.batch_size, cfg.seq_len, cfg.eval_batches)
        ]
    return _Run(
        cfg=cfg,
        model=cfg.model_config(),
        mesh=mesh,
        corpus=corpus,
        batcher=corpus.batcher(cfg.batch_size, cfg.seq_len, cfg.seed),
        val=val,
        compat=compat(cfg, corpus),
        directory=checkpoint_dir(workdir),
        kill_at=KillAt.from_env(),
    )


def _fresh(run: _Run) -> _Progress:
    _, run_key = jax.random.split(jax.random.key(run.cfg.seed))
    state = initial_state(run.cfg, run.mesh)
    rng_data = np.asarray(jax.random.key_data(run_key))  # saved so a resume is exact
    return _Progress(state, rng_data, [], [], 0, None)


def _resume(run: _Run, mgr: ocp.CheckpointManager, latest: int) -> _Progress:
    """The progress saved in checkpoint ``latest``, after checking it fits ``run``."""
    where = f"{run.directory / str(latest)}"
    meta = restore_meta(mgr, latest)
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"cannot resume from {where}: not a remat-kit checkpoint of format {FORMAT} "
            f"(found format {meta.get('format')!r}); use a fresh workdir"
        )
    check_compatible(meta["compat"], run.compat, where)
    state, meta = restore(mgr, latest, run.mesh)
    losses, val_losses = list(meta["losses"]), [tuple(p) for p in meta["val_losses"]]
    start = int(meta["step"])
    if start > run.cfg.steps:
        raise ValueError(
            f"cannot resume from {where} with steps={run.cfg.steps}: that checkpoint is "
            f"already {start} updates in; ask for more steps (--steps > {start})"
        )
    run.batcher.step = int(meta["data"]["step"])
    if int(state.step) != start or run.batcher.step != start or len(losses) != start:
        raise ValueError(f"checkpoint {where} is inconsistent: step counters disagree")
    rng_data = np.asarray(meta["rng"], np.uint32)
    return _Progress(state, rng_data, losses, val_losses, start, start)


def _start(run: _Run, mgr: ocp.CheckpointManager, resume: bool) -> _Progress:
    latest = mgr.latest_step()
    if latest is not None and not resume:
        raise ValueError(
            f"{run.directory} already holds checkpoints (latest step {latest}); pass "
            "resume=True (--resume) to continue that run, or use a fresh workdir"
        )
    return _resume(run, mgr, latest) if latest is not None else _fresh(run)


def _compile(run: _Run, start: int) -> tuple[Any, float]:
    """The compiled step and its compile time (0.0 when compiled earlier in this process)."""
    cfg = run.cfg
    if run.kill_at is not None:
        run.kill_at.check("compile", start)
    hook = run.kill_at.on_micro_batch() if run.kill_at is not None else None
    key = (run.model, opt_key(cfg), cfg.micro_batches, cfg.batch_size, cfg.seq_len, run.mesh, hook)
    hits = compiled_step.cache_info().hits
    compiled, seconds = compiled_step(*key)
    return compiled, 0.0 if compiled_step.cache_info().hits > hits else seconds


def _evaluate(run: _Run, params: Any) -> float:
    loss = eval_fn(run.model, run.mesh)
    return float(np.mean([float(loss(params, x, y)) for x, y in run.val]))


def _checkpoint(run: _Run, mgr: ocp.CheckpointManager, progress: _Progress, done: int) -> None:
    meta = {
        "format": FORMAT,
        "step": done,
        "config": run.cfg.to_dict(),
        "compat": run.compat,
        "data": run.batcher.state,
        "losses": progress.losses,
        "val_losses": [list(p) for p in progress.val_losses],
        "corpus": run.corpus.info(),
    }
    kill = run.kill_at.check if run.kill_at is not None else lambda point, step: None
    kill("before-save", done)
    save(mgr, done, progress.state, progress.rng_data, meta)
    kill("after-save", done)


def _run_steps(
    run: _Run,
    mgr: ocp.CheckpointManager,
    progress: _Progress,
    compiled: Any,
    on_step: Callable[[dict[str, Any]], None] | None,
) -> list[float]:
    """Steps ``start .. steps - 1``: update, validate, checkpoint. Returns seconds per step."""
    cfg, sharding = run.cfg, T.batch_sharding(run.mesh)
    step_times: list[float] = []
    for t in range(progress.start, cfg.steps):
        t0 = time.perf_counter()
        inputs, targets = T.put_global(run.batcher.batch_at(t), (sharding, sharding))
        progress.state, metrics = compiled(progress.state, {"inputs": inputs, "targets": targets})
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        step_times.append(time.perf_counter() - t0)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise NonFiniteLossError(t, loss, grad_norm, mgr.latest_step(), run.directory)
        progress.losses.append(loss)
        done = t + 1
        run.batcher.step = done
        info: dict[str, Any] = {"step": t, "loss": loss, "grad_norm": grad_norm,
                                "step_time_s": step_times[-1]}  # fmt: skip
        if run.val and (done % cfg.eval_every == 0 or done == cfg.steps):
            info["val_loss"] = _evaluate(run, progress.state.params)
            progress.val_losses.append((done, info["val_loss"]))
        if cfg.ckpt_every and (done % cfg.ckpt_every == 0 or done == cfg.steps):
            _checkpoint(run, mgr, progress, done)
            info["checkpoint"] = done
        if on_step is not None:
            on_step(info)
    return step_times


def train(
    cfg: TrainConfig,
    workdir: str | os.PathLike[str],
    resume: bool = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train ``cfg`` on its corpus, checkpointing into ``workdir/checkpoints``.

    Step ``t`` (0-based) takes the batch ``batch_at(t)`` of the training split, computes the loss
    with the params after ``t`` updates, and applies update ``t + 1``. Validation (mean loss over
    the first ``eval_batches`` batches of the validation split) runs after 0 updates, every
    ``eval_every`` updates and at the end; a checkpoint is saved every ``ckpt_every`` updates and
    at the end.

    Args:
      cfg: the run.
      workdir: folder for the checkpoints (created if missing).
      resume: continue from the latest complete checkpoint in ``workdir`` (a fresh start if
        there is none). Without it, a ``workdir`` that already holds checkpoints is an error.
      on_step: called after every step with ``{"step", "loss", "grad_norm", "step_time_s"}``
        (plus ``"val_loss"`` when validation ran, ``"checkpoint"`` when one was saved).

    Returns:
      A :class:`TrainResult`.

    Raises:
      ValueError: bad corpus or sizes (see :func:`trainer.data.load_corpus`); ``workdir``
        holds checkpoints and ``resume`` is False; the checkpoint's config is incompatible (the
        message names each mismatched field, checkpoint vs now); a bad ``REMAT_KIT_KILL_AT``
        (:mod:`trainer.faults`).
      NonFiniteLossError: a step's loss or gradient norm is not finite (nothing saved for it).
    """
    t_start = time.perf_counter()
    run = _set_up(cfg, workdir)
    run.directory.mkdir(parents=True, exist_ok=True)
    with open_for_writing(run.directory, cfg.keep, run.kill_at) as mgr:
        progress = _start(run, mgr, resume)
        if run.val and progress.start == 0:
            progress.val_losses.append((0, _evaluate(run, progress.state.params)))
        compiled, compile_time_s = None, 0.0
        if progress.start < cfg.steps:
            compiled, compile_time_s = _compile(run, progress.start)
        step_times = _run_steps(run, mgr, progress, compiled, on_step)
        checkpoints = sorted(mgr.all_steps())
    return TrainResult(
        config=cfg,
        losses=progress.losses,
        val_losses=progress.val_losses,
        resumed_from=progress.resumed_from,
        checkpoints=checkpoints,
        num_params=int(sum(np.prod(x.shape) for x in jax.tree.leaves(progress.state.params))),
        compile_time_s=compile_time_s,
        # The first step of a call also allocates and warms up; leave it out when there are more.
        step_time_s=float(np.mean(step_times[1:] or step_times)) if step_times else float("nan"),
        wall_time_s=time.perf_counter() - t_start,
        data=run.corpus.info(),
        mesh=str(T.MeshSpec.of(run.mesh)),
        num_processes=jax.process_count(),
    )
