"""``analyze``: compile a program's step for a target (nothing allocated) and report its memory.

Per policy, a :class:`~remat_kit.program.Program`'s step is traced once (FLOPs, remat
placement), compiled with XLA's dumps on (:mod:`remat_kit.memory.xla_compile`) and read back
(:mod:`remat_kit.memory.reading`); residuals come from :func:`~remat_kit.trace.residuals`.
Compiles run concurrently (:mod:`remat_kit.memory.runner`); repeats come from the report cache
(:mod:`remat_kit.memory.compile_cache`). The default policy set is
:func:`~remat_kit.memory.policy_set.policy_set`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import optax

from remat_kit import targets as T
from remat_kit import trace
from remat_kit.loading import require_program
from remat_kit.memory.compile_cache import CompileCache, target_fingerprint
from remat_kit.memory.policy_set import (
    given_specs,
    policy_set,
)
from remat_kit.memory.reading import Hints, xla_shape
from remat_kit.memory.report import MemoryReport, same_program_lines
from remat_kit.memory.runner import (
    DEFAULT_TOP_K,
    CompileEngine,
    Job,
    ReportOptions,
    has_twin,
    note_policy_effect,
    offload_twin_jobs,
    run_jobs,
)
from remat_kit.memory.xla_compile import CompileError
from remat_kit.placement import Placement
from remat_kit.policies import (
    PolicySpec,
    check_tags,
    get_policy_spec,
    policies_for_tags,
    policy_label,
    policy_specs,
    remat_implementation,
)
from remat_kit.program import Program
from remat_kit.pure import argument_parts, param_names, purify
from remat_kit.trace import ProgramTrace, Traced
from remat_kit.walker import (
    TagResiduals,
)
from remat_kit.zoo import PresetLike, preset


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
      *args: arrays or ``jax.ShapeDtypeStruct`` pytrees, placed on one device of ``target``.
        ``nnx.Module`` / ``nnx.Optimizer`` arguments are split into state, merged inside and
        their updated state returned (donated); reported as ``params``, ``opt_state``, ``other``.
      target: a name from :func:`remat_kit.targets.target_names` or a
        :class:`~remat_kit.targets.Target`.
      policy: a label for the report (the remat policy ``fn`` uses).
      donate_argnums: for a plain ``fn``, the arguments donated to the output.
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
    else:
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn, donate_argnums=donate_argnums)
    abstract = [T.abstractify(a, sharding) for a in pure.args]
    job = Job(
        name=label,
        what=f"{label!r} on target {tgt.name!r}" + (f" (policy {policy!r})" if policy else ""),
        target=tgt,
        lower=lambda: jitted.lower(*abstract),
        arguments=argument_parts(dataclasses.replace(pure, args=tuple(abstract)), args),
        policy=policy,
    )
    options = ReportOptions(budget_bytes, top_k, fast_compile)
    return run_jobs([job], options, workers=1)[0]  # type: ignore[return-value]


def analyze_model(
    config: PresetLike,
    batch_size: int,
    seq_len: int,
    policy: str | PolicySpec | Mapping[str, str] | None = None,
    target: str | T.Target = "local",
    optimizer: str | optax.GradientTransformation = "adamw",
    budget_bytes: int | None = None,
    top_k: int = DEFAULT_TOP_K,
    fast_compile: bool = True,
    compare_offload: bool = True,
    mesh: str | T.MeshSpec | None = None,
) -> MemoryReport:
    """The memory of a bundled model's training step (:func:`remat_kit.make_train_step`, state
    donated) from abstract shapes: :func:`analyze_policies` of :func:`remat_kit.preset`. Other
    arguments as :func:`analyze`.

    Args:
      config: a preset name (``"llama3-8b"``) or config (:data:`remat_kit.zoo.PresetLike`).
      batch_size: sequences per step.
      seq_len: tokens per sequence.
      policy: a policy name, :class:`PolicySpec` or mapping; default the config's.
      optimizer: ``"adamw"``, ``"sgd"``, ``"adafactor"`` or an optax transformation.
      mesh: ``"fsdp=8"``, ``"dp=2,fsdp=4,tp=1"`` or a :class:`remat_kit.targets.MeshSpec`: report
        per device (batch over dp*fsdp, heads / d_ff over tp; a warning when a device does over
        1.1x its even share of the matmuls).
      compare_offload: also compile an offloading policy without offload
        (``peak_bytes_without_offload``).

    Returns:
      A :class:`MemoryReport` with residuals, logits line and recompute ratio.

    Raises:
      ValueError: unknown preset, policy, target or optimizer; non-positive batch or sequence;
        ``seq_len > config.max_seq_len``.
      CompileError: XLA could not compile the step (message names the policy).
    """
    program = preset(config, batch_size, seq_len, optimizer, mesh)
    chosen = policy if policy is not None else program.known.default_policy
    (report,) = analyze_policies(
        program, [chosen], target, budget_bytes, top_k, fast_compile, workers=1,
        compare_offload=compare_offload, no_remat_baseline=False,
    )  # fmt: skip
    return report  # type: ignore[return-value]


def effective_spec(spec: PolicySpec, tags: frozenset[str]) -> PolicySpec:
    """``spec`` with its saved and offloaded names cut down to the emitted ``tags``."""
    if spec.base != "names" or spec.tags <= tags:
        return spec
    return dataclasses.replace(spec, save=spec.save & tags, offload=spec.offload & tags)


def _effective_key(spec: PolicySpec, tags: frozenset[str]) -> tuple:
    eff = effective_spec(spec, tags)
    return (eff.base, eff.wrap, tuple(sorted(eff.save)), tuple(sorted(eff.offload)))


def _spec_notes(setup: ProgramTrace, spec: PolicySpec) -> tuple[str, ...]:
    """What is known about ``spec`` on the program before compiling."""
    notes = []
    if setup.program.make_loss is None:
        notes.append(
            "no residual table: give the program's loss (Program.from_loss, or make_loss= in "
            "Program.from_step) for residuals by checkpoint tag"
        )
    whole = setup.target.num_devices or 1
    if setup.placement.devices < whole:
        fix = (
            "--mesh / mesh= shards a preset over them (docs/tpu.md)"
            if setup.program.family is not None
            else "its layout's mesh is that size (remat_kit.sharded)"
            if setup.program.layout is not None
            else "a Program's arguments are placed on one device: its figures are one chip "
            "running the whole step, unsharded (lay it out over the chips with "
            "dataclasses.replace(program, layout=remat_kit.sharded(...)))"
        )
        notes.append(
            f"compiled on {setup.placement.devices} of {setup.target.name}'s {whole} devices "
            f"(chips): {fix}"
        )
    if setup.program.layout is not None and setup.placement.devices > 1 and setup.program.make_loss:
        notes.append(
            "residuals are the whole step's (the traced, global shapes), the peak per device"
        )
    if not spec.wrap and setup.reach.no_remat_note():
        notes.append(setup.reach.no_remat_note())
    elif setup.reach.without_policy:
        notes.append(
            f"no recompute ratio: {setup.program.name!r}'s no-remat step is itself "
            f"rematerialised ({setup.reach.without_policy} remat segment(s) built for None)"
        )
    if spec.base == "names" and spec.tags and not spec.tags & setup.tags:
        notes.append(
            f"names {', '.join(sorted(spec.tags))}: none emitted by {setup.program.name!r}, "
            "so it runs as save-nothing"
        )
    else:  # a registered policy naming only some emitted tags: as recommend and doctor say it
        fit = policies_for_tags([spec], setup.tags)
        notes.extend(fit.notes(repr(setup.program.name), named=False))
    return tuple(notes)


def _hints(program: Program, rows: Sequence[TagResiduals], placement: Placement) -> Hints:
    names = trace.buffer_names(program, rows, placement)
    return Hints(
        logits_elems=names.logits_elems,
        stacked={xla_shape(d, s): tags for (d, s), tags in names.stacked.items()},
        param_shapes=frozenset(xla_shape(d, s) for d, s in names.params),
    )


def _job(traced: Traced, visible: bool = True) -> Job:
    """The compile job of one traced policy."""
    setup, spec, rows = traced.program_trace, traced.spec, traced.residuals
    program, placement = setup.program, setup.placement
    placed = dataclasses.replace(traced.pure, args=tuple(placement.place(traced.pure.args)))

    def kept(memory: str) -> int | None:
        return None if rows is None else sum(r.nbytes for r in rows if r.memory == memory)

    return Job(
        name=program.title,
        what=f"policy {policy_label(spec)!r} of {program.name!r} on target {setup.target.name!r}",
        target=setup.target,
        lower=traced.stage.lower,
        arguments=argument_parts(placed, program.args),
        policy=policy_label(spec),
        flops_no_remat=setup.flops_no_remat,
        residuals=rows or (),
        activation_bytes=kept("device"),
        offloaded_bytes=kept("host"),
        logits=program.known.logits,
        model=program.name,
        batch_size=program.known.batch_size,
        seq_len=program.known.seq_len,
        hints=_hints(program, rows or (), placement),
        visible=visible,
        notes=_spec_notes(setup, spec),
        flops_traced=traced.flops,
        remat=traced.remat,
        label=policy_label(spec),
        mesh_devices=placement.devices if placement.mesh is not None else None,
        program_key=repr((id(setup), _effective_key(spec, setup.tags))),
    )


def _program_job(setup: ProgramTrace, spec: PolicySpec, visible: bool = True) -> Job:
    """One policy's compile job; traces the step once (FLOPs, remat placement, lowering)."""
    return _job(trace.trace_policy(setup, spec), visible)


def analyze_policies(
    program: Program,
    policies: Sequence[str | PolicySpec | Mapping[str, str]] | None = None,
    target: str | T.Target = "local",
    budget_bytes: int | None = None,
    top_k: int = DEFAULT_TOP_K,
    fast_compile: bool = True,
    workers: int | None = None,
    raise_errors: bool = True,
    compare_offload: bool = True,
    strict_tags: bool = True,
    engine: CompileEngine | None = None,
    policy_alone_peak: bool = False,
    no_remat_baseline: bool = True,
) -> list[MemoryReport | CompileError]:
    """Compile a program under each policy for ``target`` and report its memory; policies that
    act the same (:func:`effective_spec`) compile once, sharing ``program_sha256``. Other
    arguments as :func:`remat_kit.analyze`.

    Args:
      program: a :class:`~remat_kit.program.Program`.
      policies: names, :class:`PolicySpec` or per-tag mappings; None: the default set of
        :func:`~remat_kit.memory.policy_set.policy_set`.
      workers: concurrent compiles (default ``min(4, cpu_count - 1)``).
      raise_errors: False: a failed policy gives its CompileError.
      compare_offload: as :func:`analyze_model`.
      strict_tags: raise on a user spec naming a tag the program never emits.
      engine: the :class:`~remat_kit.memory.runner.CompileEngine` (None: a new one).
      policy_alone_peak: recompile with XLA's remat pass off where it acted
        (``policy_only.peak_bytes``).
      no_remat_baseline: also compile ``no-remat`` unseen, for
        :func:`remat_kit.memory.undone.memory_not_freed`.

    Returns:
      One :class:`MemoryReport` per policy (or CompileError); same-program warnings from
      :func:`~remat_kit.memory.report.same_program_lines`.

    Raises:
      ValueError: unknown policy or target; a user spec naming a tag the program never emits;
        a factory that passes the policy to no remat segment
        (:class:`~remat_kit.reach.PolicyReach`).
      CompileError: with ``raise_errors``, the first policy that failed to lower or compile.
    """
    require_program(program)
    tgt = T.get_target(target)
    # unknown names fail before any work; save_any_names_but_these traces the tags once, here
    specs = given_specs(program, policies) if policies is not None else None
    options = (budget_bytes, top_k, fast_compile, compare_offload, policy_alone_peak,
               strict_tags, no_remat_baseline)  # fmt: skip
    cache, key = _request_cache(program, specs, tgt, options)
    if key is not None and (cached := _cached_reports(cache, key, len(specs))) is not None:
        return cached  # the same request made before: its reports, nothing compiled
    setup = trace.trace_program(program, tgt)
    specs = _reached(setup, specs)
    first, distinct = _distinct(setup, specs, strict_tags)
    jobs, total = _jobs(
        setup, [specs[i] for i in distinct], compare_offload, policy_alone_peak, no_remat_baseline
    )
    with T.activation_sharding(setup.placement.mesh):  # lowering under the mesh, as traced
        results = run_jobs(
            jobs, ReportOptions(budget_bytes, top_k, fast_compile), workers, raise_errors,
            engine, total,
        )  # fmt: skip
    out = _every_policy(setup, specs, first, dict(zip(distinct, results, strict=False)))
    if key is not None and all(isinstance(r, MemoryReport) for r in out):
        cache.store_json(key, {"reports": [r.to_dict() for r in out]})
    return out


def _reached(setup: ProgramTrace, specs: list[PolicySpec] | None) -> list[PolicySpec]:
    """The specs to compile (None: the default set, read from the program's remat). Raises
    ValueError where a spec needs the policy passed on and the factories do not."""
    if specs is None and not setup.reach.passes:
        raise ValueError(setup.reach.error())
    if specs is None:
        specs = list(policy_set(setup.program, setup.target, tags=setup.tags).specs)
    if any(spec.wrap for spec in specs) and not setup.reach.passes:
        raise ValueError(setup.reach.error())
    return specs


def _distinct(
    setup: ProgramTrace, specs: list[PolicySpec], strict_tags: bool
) -> tuple[dict[tuple, int], list[int]]:
    """The index of the first of each set of ``specs`` that act the same on the program (by
    :func:`effective_spec`: compiled once for them all) and those indices in order; with
    ``strict_tags``, a user's own spec is first checked against the emitted tags.

    Raises:
      ValueError: a user's spec naming a tag the program does not emit (``strict_tags``).
    """
    registered = policy_specs()
    for spec in specs:
        if strict_tags and registered.get(spec.name) != spec:  # the user's own spec
            check_tags(spec, setup.tags, f"program {setup.program.name!r}")
    first: dict[tuple, int] = {}
    for i, spec in enumerate(specs):
        first.setdefault(_effective_key(spec, setup.tags), i)
    return first, list(dict.fromkeys(first.values()))


def _request_cache(
    program: Program, specs: list[PolicySpec] | None, tgt: T.Target, options: tuple
) -> tuple[CompileCache | None, str | None]:
    """The report cache and this request's key in it (None: the cache is off, or the program
    cannot say what decides its trace without tracing: a user's program, or no specs yet)."""
    cache = CompileCache.from_env()
    if cache is None or program.known.cache_key is None or specs is None:
        return cache, None
    # what decides the trace beside the request: the remat implementation (jax_remat3 runs
    # some policies as others) and the JAX flags that change dtypes or matmul precision
    tracing = (
        remat_implementation(), jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
    )  # fmt: skip
    key = CompileCache.request_key(
        "analyze_policies", program.known.cache_key, specs, target_fingerprint(tgt), *options,
        tracing,
    )  # fmt: skip
    return cache, key


def _jobs(
    setup: ProgramTrace,
    own_specs: list[PolicySpec],
    compare_offload: bool,
    policy_alone_peak: bool,
    no_remat_baseline: bool,
) -> tuple[Iterator[Job], int]:
    """The compile jobs of ``own_specs`` (each traced when due, while the ones before it
    compile), their offload twins and, where asked, the unseen no-remat baseline; and how many.

    Whether a policy's fewer residuals lower the compiled memory is judged against the
    no-remat step of the same run (:func:`~remat_kit.memory.runner.run_jobs`), as the doctor
    judges it: compiled unseen when not asked for (not when no-remat itself remats)."""
    baseline = (
        no_remat_baseline
        and bool(own_specs)
        and all(spec.wrap for spec in own_specs)
        and not setup.reach.without_policy
    )

    def jobs() -> Iterator[Job]:
        made = []
        for spec in own_specs:
            job = note_policy_effect(_program_job(setup, spec), spec, setup.target)
            job.policy_only = policy_alone_peak
            made.append(job)
            yield job
        yield from offload_twin_jobs(
            made, own_specs, setup.target, compare_offload,
            lambda twin: _program_job(setup, twin, visible=False),
        )  # fmt: skip
        if baseline:
            yield _program_job(setup, get_policy_spec("no-remat"), visible=False)

    total = len(own_specs) + sum(has_twin(s, setup.target, compare_offload) for s in own_specs)
    return jobs(), total + baseline


def _every_policy(
    setup: ProgramTrace, specs: list[PolicySpec], first: dict[tuple, int], own: dict[int, Any]
) -> list[MemoryReport | CompileError]:
    """One result per spec from the compiled ones (``own``, by index): a spec acting as an
    earlier one gets that one's result under its own name; policies that compiled to one
    program without acting the same by construction say so in their warnings."""
    out = []
    for i, spec in enumerate(specs):
        j = first[_effective_key(spec, setup.tags)]
        out.append(own[i] if i == j else _same_program(setup, spec, specs[j], own[j]))
    expected = [first[_effective_key(spec, setup.tags)] for spec in specs]
    labels = [policy_label(spec) for spec in specs]
    cause = setup.reach.after_gradient_cause()
    for i, lines in enumerate(same_program_lines(labels, out, expected, cause)):
        if lines:
            out[i] = dataclasses.replace(out[i], warnings=(*out[i].warnings, *lines))
    return out


def _same_program(
    setup: ProgramTrace, spec: PolicySpec, compiled: PolicySpec, result: MemoryReport | Any
) -> MemoryReport | CompileError:
    """The result for ``spec`` when it is the same program as ``compiled`` (whose result is
    ``result``): renamed, with ``spec``'s own notes and the compile's warnings."""
    program, target = setup.program.name, setup.target.name
    what = f"policy {policy_label(spec)!r} of {program!r} on target {target!r}"
    if isinstance(result, CompileError):
        return result.renamed(what, policy_label(spec))
    theirs = _spec_notes(setup, compiled)
    warnings = tuple(w for w in result.warnings if w not in theirs)
    return dataclasses.replace(
        result, policy=policy_label(spec), warnings=_spec_notes(setup, spec) + warnings
    )


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
