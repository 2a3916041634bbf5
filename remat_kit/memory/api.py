"""``analyze``: compile a step for a target (nothing allocated) and report its memory.

Flow for a model (:func:`analyze_model`, :func:`analyze_policies`): the abstract train state,
optimizer and target shardings are built once; each policy's step is lowered (a trace) and
compiled for the target with XLA's dumps on (:mod:`remat_kit.memory.xla_compile`); its
``memory_analysis()``, live-at-peak buffers and matmul FLOPs are read back
(:mod:`remat_kit.memory.reading`). Several policies compile concurrently, identical programs once,
GPU kernels shared between compiles (:mod:`remat_kit.memory.runner`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from remat_kit import sharding as S
from remat_kit import targets as T
from remat_kit.memory.compile_cache import CompileCache, target_fingerprint
from remat_kit.memory.flops import traced_flops
from remat_kit.memory.programs import analyze_program
from remat_kit.memory.reading import Hints, xla_shape
from remat_kit.memory.report import MemoryReport
from remat_kit.memory.runner import CompileEngine, Job, add_offload_jobs, run_jobs
from remat_kit.memory.xla_compile import CompileError
from remat_kit.models.config import ModelConfig
from remat_kit.policies import PolicySpec, get_policy_spec
from remat_kit.program import Program, leaf_bytes, param_names, purify
from remat_kit.program import argument_parts as nnx_argument_parts
from remat_kit.residuals import (
    TagResiduals,
    block_residuals,
    group_by_tag,
    saved_residuals,
    split_over_tp,
)
from remat_kit.training.step import (
    abstract_batch,
    abstract_train_state,
    loss_fn,
    make_optimizer,
    make_train_step,
    sharded_train_state,
)

DEFAULT_TOP_K = 10


# -- Arguments and shardings ----------------------------------------------------------------


def argument_parts(args: Sequence[Any], names: Sequence[str]) -> dict[str, int]:
    """Bytes of each positional argument by name; an argument with ``params`` and
    ``opt_state`` attributes (a :class:`~remat_kit.training.TrainState`) is split into
    ``params`` and ``opt_state`` (its step counter counted with the optimizer state)."""
    parts: dict[str, int] = {}
    for name, arg in zip(names, args, strict=True):
        if hasattr(arg, "params") and hasattr(arg, "opt_state"):
            params = leaf_bytes(arg.params)
            parts["params"] = parts.get("params", 0) + params
            parts["opt_state"] = parts.get("opt_state", 0) + leaf_bytes(arg) - params
        else:
            parts[name] = parts.get(name, 0) + leaf_bytes(arg)
    return parts


# -- Public API -----------------------------------------------------------------------------


def analyze(
    fn: Callable[..., Any],
    *args: Any,
    target: str | T.Target = "local",
    policy: str | None = None,
    name: str | None = None,
    donate_argnums: int | Sequence[int] = (),
    budget_bytes: int | None = None,
    top_k: int = DEFAULT_TOP_K,
    fast_compile: bool = True,
) -> MemoryReport:
    """Compile ``fn(*args)`` for ``target`` and report its memory; nothing is allocated.

    Args:
      fn: any jittable function, or a ``jax.jit``-wrapped one (its ``donate_argnums`` kept).
      *args: real arrays or ``jax.ShapeDtypeStruct`` (pytrees of them); each array leaf is
        recompiled for ``target`` as a ``ShapeDtypeStruct`` with the target's single-device
        sharding. ``nnx.Module`` / ``nnx.Optimizer`` arguments (real or from
        ``nnx.eval_shape``) are split into their state, merged inside the compiled function
        and their updated state returned (and donated), so a step that mutates them keeps its
        backward pass and update; their bytes are reported as ``params``, ``opt_state`` and
        ``other``.
      target: a name from :func:`remat_kit.targets.target_names` (``local``, ``cpu``,
        ``h100-sxm``, ...) or a :class:`~remat_kit.targets.Target`.
      policy: a label for the report (the remat policy ``fn`` uses), if any.
      name: the report's name (default: ``fn``'s name).
      donate_argnums: for a plain ``fn``, the arguments donated to the output (aliased).
      budget_bytes: judge ``fits`` against this instead of the target's memory.
      top_k: how many of the largest buffers live at the peak to keep.
      fast_compile: skip LLVM/ptxas optimisation (same memory figures, faster compile).

    Returns:
      A :class:`MemoryReport`; ``flops_no_remat``, ``recompute_ratio``, ``residuals`` and
      ``logits`` are empty for an arbitrary function (see :func:`analyze_model`).

    Raises:
      ValueError: unknown target.
      CompileError: XLA could not compile ``fn`` (message: what, and XLA's first line).

    Example::

        report = remat_kit.analyze(step, state, batch, target="h100-sxm")
        print(report.peak_bytes / 2**30, "GiB")
    """
    tgt = T.get_target(target)
    sharding = T.abstract_sharding(tgt)
    label = name or getattr(getattr(fn, "__wrapped__", fn), "__name__", "fn")
    pure = purify(fn, args, param_names(fn, len(args)))
    if pure.nnx_index is not None:  # NNX objects: split, merged inside, updated state returned
        jitted = jax.jit(pure.fn, donate_argnums=(pure.nnx_index,))
        parts_of = lambda abstract: nnx_argument_parts(  # noqa: E731
            dataclasses.replace(pure, args=tuple(abstract)), args
        )
    else:
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn, donate_argnums=donate_argnums)
        parts_of = lambda abstract: argument_parts(abstract, pure.names)  # noqa: E731
    abstract = [T.abstractify(a, sharding) for a in pure.args]
    job = Job(
        name=label,
        what=f"{label!r} on target {tgt.name!r}" + (f" (policy {policy!r})" if policy else ""),
        target=tgt,
        lower=lambda: jitted.lower(*abstract),
        arguments=parts_of(abstract),
        policy=policy,
    )
    return run_jobs([job], top_k, budget_bytes, fast_compile, workers=1)[0]  # type: ignore[return-value]


def model_residuals(
    config: ModelConfig, batch_size: int, seq_len: int, tp: int = 1
) -> tuple[TagResiduals, ...]:
    """The saved residuals of the whole model under ``config``'s policy, grouped by checkpoint
    tag, from the jaxpr of one remat segment (:func:`remat_kit.residuals.block_residuals`) times
    the number of segments (``num_layers // remat_group_size``).

    A structured config (``remat_layers``, ``nested_remat`` or ``loss_chunk_size`` set) is not a
    uniform stack of segments: its rows are the saved values of the whole loss's VJP
    (:func:`remat_kit.residuals.saved_residuals`, parameters and the batch left out), each row's
    shape the stacked one (e.g. [layers, batch, seq, d_model]).

    Each segment's input (tagged ``decoder_layer_input``) is included: the layer scan keeps it
    for every segment. Parameters and the positions are not residuals here (they are arguments
    of the step). Untagged residuals are grouped as ``"<primitive>"``.

    Args:
      config: the model and its policy.
      batch_size: sequences (per device under data parallelism: the caller divides).
      seq_len: tokens per sequence.
      tp: tensor-parallel degree: tagged residuals with a heads, kv_heads or d_ff dimension
        keep ``1/tp`` of it per device (:func:`remat_kit.residuals.split_over_tp`); shapes and
        bytes in the rows are then per device.

    Raises:
      ValueError: ``tp`` is not a positive integer.
    """
    if config.layer_structure or config.loss_chunk_size is not None:
        # Not a uniform stack of segments: the forward's saved values of the whole loss.
        state = abstract_train_state(config, make_optimizer("sgd"))
        whole = saved_residuals(
            lambda p, b: loss_fn(p, config, b), state.params, abstract_batch(batch_size, seq_len)
        )
        kept = [r for r in whole if not r.is_argument]
        return tuple(group_by_tag(split_over_tp(kept, tp)))
    segments = config.num_layers // config.remat_group_size
    rows = []
    kept = [
        r
        for r in block_residuals(config, batch_size, seq_len)
        if not r.is_argument or r.source == "argument [1]"
    ]
    for row in group_by_tag(split_over_tp(kept, tp), include_arguments=True):
        rows.append(
            dataclasses.replace(row, count=row.count * segments, nbytes=row.nbytes * segments)
        )
    return tuple(rows)


@dataclasses.dataclass
class _ModelSetup:
    """What does not depend on the policy: target, shardings, abstract state and batch."""

    config: ModelConfig
    batch_size: int
    seq_len: int
    target: T.Target
    optimizer: optax.GradientTransformation
    state: Any
    batch: Any
    arguments: dict[str, int]
    flops_no_remat: float | None = None
    mesh: Any = None  # the jax Mesh (axes dp, fsdp, tp) over the target's devices; None: one


def _check_shape(
    config: ModelConfig, batch_size: int, seq_len: int, mesh: str | S.MeshSpec | None
) -> None:
    """Raise ValueError for a non-positive batch or sequence, a sequence over the model's
    ``max_seq_len``, or a batch that ``mesh``'s dp*fsdp does not divide."""
    for label, v in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{label} must be a positive integer, got {v!r}")
    if seq_len > config.max_seq_len:
        raise ValueError(
            f"seq_len={seq_len} exceeds max_seq_len={config.max_seq_len} of {config.name!r}; "
            f"pass a shorter sequence or config.replace(max_seq_len={seq_len})"
        )
    if mesh is not None:
        spec = S.parse_mesh(mesh)
        split = spec.dp * spec.fsdp
        if batch_size % split:
            raise ValueError(
                f"batch_size={batch_size} is not divisible by dp*fsdp={split} of mesh {spec}"
            )


def _setup(
    config: ModelConfig,
    batch_size: int,
    seq_len: int,
    target: str | T.Target,
    optimizer: str | optax.GradientTransformation,
    mesh: str | S.MeshSpec | None = None,
) -> _ModelSetup:
    _check_shape(config, batch_size, seq_len, mesh)
    tgt = T.get_target(target)
    opt = make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
    if mesh is None:
        sharding = T.abstract_sharding(tgt)
        state = T.abstractify(abstract_train_state(config, opt), sharding)
        batch = T.abstractify(abstract_batch(batch_size, seq_len), sharding)
    else:  # per-device figures on a (dp, fsdp, tp) mesh of the target's devices
        spec = S.parse_mesh(mesh)
        mesh = S.make_mesh(spec, T.compile_devices(tgt, spec.num_devices))
        state, _ = sharded_train_state(config, opt, mesh)
        batch = T.abstractify(abstract_batch(batch_size, seq_len), S.batch_sharding(mesh))
    return _ModelSetup(
        mesh=mesh,
        config=config,
        batch_size=batch_size,
        seq_len=seq_len,
        target=tgt,
        optimizer=opt,
        state=state,
        batch=batch,
        arguments=argument_parts([state, batch], ["state", "batch"]),
    )


def _baseline_flops(setup: _ModelSetup) -> float:
    """The no-remat step's matmul FLOPs from its trace; on a mesh, the even share per device.

    The plain step: no remat on any layer, no nested scan, whole logits; the config's
    ``attention`` is kept (cuDNN's fused attention is counted by its matmul work, see
    :mod:`remat_kit.memory.flops`), so the ratio is against the same attention without remat.

    The trace counts the whole (global) step. On a mesh this even share is not the report's
    baseline: a device may compute more than ``1/devices`` of the step (what XLA leaves
    replicated or pads), remat or not, so the runner takes the baseline per device from the
    compiled program (:func:`remat_kit.memory.runner._per_device_baseline`) and keeps this
    figure to tell replicated work.
    """
    if setup.flops_no_remat is None:
        config = setup.config.replace(
            remat_policy="no-remat", remat_layers=None, nested_remat=False, nested_groups=None,
            loss_chunk_size=None,
        )  # fmt: skip
        step = make_train_step(config, setup.optimizer, jit=False)
        devices = setup.mesh.size if setup.mesh is not None else 1
        # A layer structure stacks its parameters differently: the plain step's own state.
        state = (
            abstract_train_state(config, setup.optimizer)
            if setup.config.layer_structure
            else setup.state
        )
        setup.flops_no_remat = traced_flops(step, state, setup.batch) / devices
    return setup.flops_no_remat


def _model_job(setup: _ModelSetup, spec: PolicySpec, visible: bool = True) -> Job:
    config = setup.config.replace(remat_policy=spec)
    step = make_train_step(config, setup.optimizer, donate=True)
    # Per device: dp and fsdp split the batch; tp splits the heads / kv_heads / d_ff dimension.
    shape = dict(setup.mesh.shape) if setup.mesh is not None else {}
    split = shape.get("dp", 1) * shape.get("fsdp", 1)
    residuals = model_residuals(
        config, setup.batch_size // split, setup.seq_len, shape.get("tp", 1)
    )
    b, s = setup.batch_size, setup.seq_len
    segments = config.num_layers // config.remat_group_size
    stacked: dict[str, tuple[str, ...]] = {}
    for row in residuals:
        key = xla_shape(row.dtype, (segments, *row.shape))
        stacked[key] = (*stacked.get(key, ()), row.tag)
    hints = Hints(
        logits_elems=b * s * config.vocab_size,
        stacked=stacked,
        param_shapes=frozenset(
            xla_shape(jnp.dtype(x.dtype).name, x.shape) for x in jax.tree.leaves(setup.state.params)
        ),
    )
    return Job(
        name=f"{setup.config.name} b={b} s={s}",
        what=f"policy {spec.name!r} on target {setup.target.name!r}",
        target=setup.target,
        lower=lambda: step.lower(setup.state, setup.batch),
        arguments=dict(setup.arguments),
        policy=spec.name,
        flops_no_remat=_baseline_flops(setup),
        residuals=residuals,
        activation_bytes=sum(r.nbytes for r in residuals if r.memory == "device"),
        offloaded_bytes=sum(r.nbytes for r in residuals if r.memory == "host"),
        logits=((b, s, setup.config.vocab_size), setup.config.dtype),
        hints=hints,
        model=setup.config.name,
        batch_size=b,
        seq_len=s,
        visible=visible,
        mesh_devices=setup.mesh.size if setup.mesh is not None else None,
        # Same selection rule, same program: the twin of an offload policy is usually another
        # registered policy (offload-qkv-proj's is save-qkv-proj).
        program_key=repr(
            (id(setup), spec.base, sorted(spec.save), sorted(spec.offload), spec.wrap)
        ),
    )


def _model_jobs(
    setup: _ModelSetup, specs: Sequence[PolicySpec], compare_offload: bool
) -> list[Job]:
    jobs = [_model_job(setup, spec) for spec in specs]
    return add_offload_jobs(
        jobs, specs, setup.target, compare_offload,
        lambda twin: _model_job(setup, twin, visible=False),
    )  # fmt: skip


def analyze_model(
    config: ModelConfig | str,
    batch_size: int,
    seq_len: int,
    policy: str | PolicySpec | Mapping[str, str] | None = None,
    target: str | T.Target = "local",
    optimizer: str | optax.GradientTransformation = "adamw",
    budget_bytes: int | None = None,
    top_k: int = DEFAULT_TOP_K,
    fast_compile: bool = True,
    compare_offload: bool = True,
    mesh: str | S.MeshSpec | None = None,
) -> MemoryReport:
    """Report the memory of a whole training step of a model, from abstract shapes only.

    The step is :func:`remat_kit.make_train_step`: forward, backward under ``policy``, optax
    update; the train state (parameters, optimizer state, step) is donated, so the update is in
    place as in a real loop. Parameters and optimizer state are ``jax.eval_shape`` shapes: the
    model is never allocated, and a 70B model can be analysed for an 8-GPU target on a laptop.

    Args:
      config: a :class:`ModelConfig` or a preset name (``"llama3-8b"``).
      batch_size: sequences per step (b).
      seq_len: tokens per sequence (s).
      policy: a policy name, :class:`PolicySpec` or custom mapping; default the config's.
      target: where to compile (see :func:`analyze`).
      optimizer: ``"adamw"``, ``"sgd"``, ``"adafactor"`` or an optax transformation.
      budget_bytes: as :func:`analyze`.
      top_k: as :func:`analyze`.
      fast_compile: as :func:`analyze`.
      mesh: ``"fsdp=8"``, ``"dp=2,fsdp=4,tp=1"`` or a :class:`remat_kit.sharding.MeshSpec`:
        compile for that many devices of the target and report per device: arguments and
        peak; the residual table (batch split over dp*fsdp, heads / kv_heads / d_ff dimensions
        of tagged residuals over tp); ``flops`` and ``flops_no_remat`` (the compiled step's
        matmuls less the recomputed ones: work XLA replicates over the mesh is in both, and a
        warning says when a device does over 1.1x its even share).
      compare_offload: for an offloading policy on a target where offload is real, also
        compile the same policy keeping those tensors on device, and report its peak
        (``peak_bytes_without_offload``): whether offloading helped is measured, not assumed.

    Returns:
      A :class:`MemoryReport` with the residual table, the logits line, and the recompute ratio
      (compiled matmul FLOPs over those of the same step traced without remat).

    Raises:
      ValueError: unknown preset, policy, target or optimizer; non-positive batch or sequence;
        ``seq_len > config.max_seq_len``.
      CompileError: XLA could not compile the step (message names the policy).
    """
    config = _resolve_config(config)
    chosen = policy if policy is not None else config.remat_policy
    (report,) = analyze_model_policies(
        config, batch_size, seq_len, [chosen], target, optimizer, budget_bytes, top_k,
        fast_compile, workers=1, compare_offload=compare_offload, mesh=mesh,
    )  # fmt: skip
    return report  # type: ignore[return-value]


def analyze_policies(
    config: ModelConfig | str | Program, *args: Any, **kwargs: Any
) -> list[MemoryReport | CompileError]:
    """Compare policies on one program: a bundled model or the user's own.

    - ``analyze_policies(config, batch_size, seq_len, policies, target=..., ...)``: a
      :class:`ModelConfig` or preset name (:func:`analyze_model_policies`).
    - ``analyze_policies(program, policies, target=..., ...)``: a user's
      :class:`~remat_kit.program.Program` (their own linen, NNX or plain-JAX step; policies may
      be per-tag specs in the program's own tag names): :func:`analyze_program`.

    Returns:
      One :class:`MemoryReport` per policy (or :class:`CompileError` with
      ``raise_errors=False``), in order.
    """
    if isinstance(config, Program):
        return analyze_program(config, *args, **kwargs)
    return analyze_model_policies(config, *args, **kwargs)


def analyze_model_policies(
    config: ModelConfig | str,
    batch_size: int,
    seq_len: int,
    policies: Sequence[str | PolicySpec | Mapping[str, str]],
    target: str | T.Target = "local",
    optimizer: str | optax.GradientTransformation = "adamw",
    budget_bytes: int | None = None,
    top_k: int = DEFAULT_TOP_K,
    fast_compile: bool = True,
    workers: int | None = None,
    raise_errors: bool = True,
    compare_offload: bool = True,
    mesh: str | S.MeshSpec | None = None,
    separate_xla_remat: bool = True,
    engine: CompileEngine | None = None,
) -> list[MemoryReport | CompileError]:
    """:func:`analyze_model` for several policies, sharing what does not depend on the policy.

    The abstract state, optimizer, target topology and the no-remat FLOPs baseline are built
    once; policies are lowered one after another while earlier ones compile, ``workers`` at a
    time (default ``min(4, cpu_count)``), identical programs once, GPU kernels shared
    (:mod:`remat_kit.memory.runner`). An offloading policy's on-device counterpart (see
    ``compare_offload``) is usually another registered policy and then costs nothing extra.

    With ``separate_xla_remat`` (default), a policy whose program XLA's own rematerialisation
    pass changed is compiled again with the pass off: ``recompute_ratio`` and ``policy_only``
    are then the policy's own figures (see :mod:`remat_kit.memory.policy_only`).
    ``engine``: compile through this :class:`~remat_kit.memory.runner.CompileEngine` and leave
    the executables in it (the sweep then runs them instead of compiling its steps again).

    Returns:
      One report per policy, in order; with ``raise_errors=False`` a policy that fails to
      compile gives its :class:`CompileError` instead of a report.

    Raises:
      ValueError: as :func:`analyze_model` (checked before anything compiles).
      CompileError: with ``raise_errors``, the first policy that failed to compile.
    """
    config = _resolve_config(config)
    specs = [get_policy_spec(p) for p in policies]  # unknown names fail before any work
    _check_shape(config, batch_size, seq_len, mesh)
    cache = CompileCache.from_env() if isinstance(optimizer, str) else None
    key = None
    if cache is not None:  # the same request made before: its reports, nothing traced
        key = CompileCache.request_key(
            "analyze_model_policies", config, batch_size, seq_len, specs,
            target_fingerprint(T.get_target(target)), optimizer, budget_bytes, top_k,
            fast_compile, compare_offload, mesh, separate_xla_remat,
        )  # fmt: skip
        cached = _cached_reports(cache, key, len(specs))
        if cached is not None:
            return cached
    setup = _setup(config, batch_size, seq_len, target, optimizer, mesh)
    jobs = _model_jobs(setup, specs, compare_offload)
    for job in jobs:
        job.policy_only = separate_xla_remat and job.visible
    with S.activation_sharding(setup.mesh):  # lowering traces the model under the mesh
        results = run_jobs(jobs, top_k, budget_bytes, fast_compile, workers, raise_errors, engine)
    results = results[: len(specs)]
    if key is not None and all(isinstance(r, MemoryReport) for r in results):
        cache.store_json(key, {"reports": [r.to_dict() for r in results]})  # type: ignore[union-attr]
    return results


def _cached_reports(cache: CompileCache, key: str, count: int) -> list[MemoryReport] | None:
    """The reports stored under ``key`` (as read from the cache), or None."""
    data = cache.load_json(key)
    if data is None:
        return None
    try:
        reports = [MemoryReport.from_dict(d) for d in data["reports"]]
    except (KeyError, TypeError, ValueError):  # written by another layout: recompute
        return None
    if len(reports) != count:
        return None
    return [dataclasses.replace(r, compile_cached=True) for r in reports]


def _resolve_config(config: ModelConfig | str) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return config
    from remat_kit.models.config import get_config

    return get_config(config)
