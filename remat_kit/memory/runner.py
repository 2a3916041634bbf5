"""Compile many steps quickly: lower in order, compile in a thread pool, share GPU kernels.

:class:`CompileEngine` (shared by analyzer and sweep) lowers in the calling thread and compiles
in worker threads, identical programs once. On GPU targets the first compile fills XLA's kernel
cache, copied per worker (docs/performance.md); memory figures do not depend on it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from remat_kit import targets as T
from remat_kit.memory import calibration, roofline
from remat_kit.memory.compile_cache import (
    CompileCache,
    cost_fields,
    keep_kernels,
    kernel_cache_file,
)
from remat_kit.memory.host_buffers import host_buffers, host_line
from remat_kit.memory.policy_only import policy_only_figures, xla_remat_line
from remat_kit.memory.reading import (
    DumpReading,
    Hints,
    compiled_peak_bytes,
    log_warnings,
    memory_parts,
    read_dump,
    unknown_memory_fields,
)
from remat_kit.memory.report import LogitsLine, MemoryReport, PolicyOnly
from remat_kit.memory.timeline import Timeline, build_timeline
from remat_kit.memory.undone import (  # noqa: F401 (cse_undone: the doctor reads it here)
    CSE_UNDID_ALL,
    CSE_UNDID_PART,
    cse_undone,
    memory_not_freed,
    recompute_undone,
)
from remat_kit.memory.xla_compile import (
    WITHOUT_XLA_REMAT,
    CompileError,
    CompileResult,
    add_policy_only,
    capture_compiler_log,
    compile_options,
    compile_with_dump,
    jax_backend_description,
    lower_for,
)
from remat_kit.policies import on_device_twin, policy_effect, remat_implementation
from remat_kit.units import format_bytes
from remat_kit.walker import RematPlacement, TagResiduals

#: How many of the largest buffers live at the peak a report keeps by default.
DEFAULT_TOP_K = 10


@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """The options of :func:`remat_kit.analyze` every report of one :func:`run_jobs` shares
    (``fast_compile``: :data:`remat_kit.memory.xla_compile.FAST_COMPILE_OPTIONS`)."""

    budget_bytes: int | None = None
    top_k: int = DEFAULT_TOP_K
    fast_compile: bool = True


@dataclasses.dataclass
class Job:
    """One step to compile and report on; ``lower`` returns its ``jax.stages.Lowered``."""

    name: str
    what: str  # names the step in errors: "policy 'x' on target 'y'"
    target: T.Target
    lower: Callable[[], Any]
    arguments: dict[str, int]
    policy: str | None = None
    flops_no_remat: float | None = None
    residuals: tuple[TagResiduals, ...] = ()
    activation_bytes: int | None = None
    offloaded_bytes: int | None = None
    logits: tuple[tuple[int, int, int], str] | None = None  # (b, s, vocab), compute dtype
    hints: Hints = dataclasses.field(default_factory=Hints)
    model: str | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    #: Index (in the same run) of the job that keeps this job's offloaded tags on device.
    on_device_twin: int | None = None
    #: False for jobs compiled only to compare with another (their failures never raise).
    visible: bool = True
    #: Warnings known before compiling.
    notes: tuple[str, ...] = ()
    #: Jobs with equal keys lower to the same program: lowered and compiled once.
    program_key: str | None = None
    #: Devices of the mesh (None: one); see :func:`_per_device_baseline`.
    mesh_devices: int | None = None
    #: Recompile with XLA's remat pass off where it acted (``policy_only.peak_bytes``).
    policy_only: bool = False
    #: Matmul FLOPs of the traced step under this policy (None: not traced).
    flops_traced: float | None = None
    #: Where the remat regions are, for :mod:`remat_kit.memory.undone` (None: not known).
    remat: RematPlacement | None = None
    #: The policy as its report's row names it (``custom: attn_in=save``), for warnings.
    label: str | None = None
    #: ``classic`` / ``remat3``, read in the thread that lowers the job.
    remat_impl: str = dataclasses.field(default_factory=remat_implementation)
    #: What the policy runs as there when not as named (``save-nothing``), else None.
    runs_as: str | None = None


#: Per-device matmul work above this multiple of the even split is reported as replicated.
_REPLICATION_WARN = 1.1


def _per_device_baseline(job: Job, flops: float | None, recomputed: float | None):
    """``(flops_no_remat, warnings)`` of one compiled job. On a mesh the baseline is the
    compiled device's matmuls less recomputed ones (XLA may replicate or pad work, so the even
    split of the traced FLOPs is not it); the even split only flags replication."""
    if job.mesh_devices is None or not flops or recomputed is None:
        return job.flops_no_remat, []
    compiled = flops - recomputed
    warnings = []
    if job.flops_no_remat and compiled > _REPLICATION_WARN * job.flops_no_remat:
        warnings.append(
            f"each device does {compiled / job.flops_no_remat:.2f}x its even share (1/"
            f"{job.mesh_devices}) of the step's matmul FLOPs: XLA replicated part of the "
            "computation over the mesh (the recompute ratio uses the compiled per-device work)"
        )
    return compiled, warnings


def default_workers() -> int:
    """One per core, at most 4 (docs/performance.md)."""
    return max(1, min(4, os.cpu_count() or 1))


class _KernelCaches:
    """A kernel-cache file per worker thread, seeded from the first compile's, which starts from
    :func:`~remat_kit.memory.compile_cache.kernel_cache_file`; :meth:`keep` writes it back."""

    def __init__(self, folder: str, kept: Callable[[T.Target], Path | None]):
        self.folder = folder
        self.seed = os.path.join(folder, "seed.kcache")
        self._kept = kept
        self._targets: dict[str, T.Target] = {}
        self._local = threading.local()
        self._count = 0
        self._lock = threading.Lock()

    def _start(self, target: T.Target, path: str, source: str | None) -> None:
        """Start ``path`` from ``source``, else from the kept file of ``target`` (if any)."""
        with self._lock:
            self._targets[target.name] = target
        if os.path.exists(path):  # started already: nothing to look up on later compiles
            return
        kept = self._kept(target) if source is None else None
        if kept is not None and kept.exists():
            source = str(kept)
        if source is not None:
            try:
                shutil.copyfile(source, path)
            except OSError:  # removed meanwhile: start empty
                pass

    def options(self, target: T.Target, seeding: bool) -> dict[str, Any]:
        if target.platform != "cuda":
            return {}
        if seeding:
            self._start(target, self.seed, None)
            return {"xla_gpu_kernel_cache_file": self.seed}
        path = getattr(self._local, "path", None)
        if path is None:
            with self._lock:
                self._count += 1
                path = os.path.join(self.folder, f"worker{self._count}.kcache")
            self._local.path = path
        self._start(target, path, self.seed if os.path.exists(self.seed) else None)
        return {"xla_gpu_kernel_cache_file": path}

    def keep(self) -> None:
        """Write the fullest kernel file back, when every compile was for one target."""
        if len(self._targets) != 1:
            return
        kept = self._kept(next(iter(self._targets.values())))
        files = [Path(self.folder, f) for f in os.listdir(self.folder) if f.endswith(".kcache")]
        if kept is not None and files:
            keep_kernels(max(files, key=lambda f: f.stat().st_size), kept)


@dataclasses.dataclass(frozen=True)
class _Read:
    """What :func:`_read` reads from a job's compile."""

    parts: dict[str, int | None]
    reading: DumpReading
    step_time: roofline.StepTime | None
    timeline: Timeline | None


def _read(job: Job, result: CompileResult, top_k: int) -> _Read:
    """Read ``job``'s compile (in a worker: no log lines needed); a hidden job gets memory and
    FLOPs only."""
    parts = memory_parts(result.compiled, unknown_as_none=True)
    shown = job.visible
    return _Read(
        parts,
        read_dump(result.dump, top_k, job.hints),
        roofline.step_time_of(job.target, result.dump, parts, cost_fields(result.compiled))
        if shown
        else None,
        build_timeline(result.dump, job.hints) if shown else None,
    )


def _report(
    job: Job, result: CompileResult, options: ReportOptions, read: _Read | None
) -> MemoryReport:
    """``job``'s report from its compile and ``read`` (:func:`_read`, made here when None)."""
    read = read or _read(job, result, options.top_k)
    parts, reading = read.parts, read.reading
    # None when the backend left a field unknown (never 0); XLA's own peak on TPU
    peak = compiled_peak_bytes(result.compiled, job.target.platform, parts)
    budget = options.budget_bytes
    budget = budget if budget is not None else job.target.memory_bytes
    baseline, baseline_warnings = _per_device_baseline(job, reading.flops, reading.recomputed_flops)
    ratio = reading.flops / baseline if reading.flops and baseline else None
    # XLA's own remat told apart
    policy_only = policy_only_figures(result, reading, baseline, job.target.platform)
    dump_warnings, xla_line = _xla_lines(job, result, read, peak, ratio, policy_only)
    step_time = read.step_time
    return MemoryReport(
        name=job.name,
        target=job.target.name,
        platform=job.target.platform,
        backend=jax_backend_description(job.target.platform, job.target.deviceless),
        policy=job.policy,
        peak_bytes=peak,
        **parts,
        arguments=_arguments(job, parts),
        flops=reading.flops,
        flops_no_remat=baseline,
        recompute_ratio=policy_only.recompute_ratio if policy_only else ratio,
        compiled_recompute_ratio=ratio,
        timeline=read.timeline,
        policy_only=policy_only,
        residuals=job.residuals,
        activation_bytes=job.activation_bytes,
        offloaded_bytes=job.offloaded_bytes,
        logits=_logits_line(job, reading),
        peak_buffers=reading.peak_buffers,
        live_peak_bytes=reading.live_peak_bytes,
        memory_bytes=job.target.memory_bytes,
        budget_bytes=budget,
        fits=None if budget is None or peak is None else peak <= budget,
        compile_s=round(result.compile_s, 3),
        compile_cached=result.cached,
        warnings=job.notes
        + _unknown_line(result)
        + tuple(log_warnings(result))
        + dump_warnings
        + tuple(baseline_warnings)
        + xla_line,
        model=job.model,
        batch_size=job.batch_size,
        seq_len=job.seq_len,
        step_time_s=step_time.step_time_s if step_time else None,
        step_time=step_time,
        remat_impl=job.remat_impl,
        jax_version=jax.__version__,
        runs_as=job.runs_as,
    )


def _unknown_line(result: CompileResult) -> tuple[str, ...]:
    """The warning (none or one) naming the memory fields the backend left unknown."""
    unknown = unknown_memory_fields(result.compiled)
    if not unknown:
        return ()
    return (
        f"the backend reports {', '.join(unknown)} as unknown (memory_analysis() gave None "
        "or -1): the peak and whether it fits are unknown, not 0",
    )


def _arguments(job: Job, parts: dict[str, int | None]) -> dict[str, int]:
    """The step's argument bytes by name, with ``other`` for compiled bytes no name holds."""
    arguments = dict(job.arguments)
    if parts["argument_bytes"] is not None:
        unaccounted = parts["argument_bytes"] - sum(arguments.values())
        if unaccounted:
            arguments["other"] = unaccounted
    return arguments


def _logits_line(job: Job, reading: DumpReading) -> LogitsLine | None:
    """The logits' shape, dtype and bytes (None when the job names no logits)."""
    if not job.logits:
        return None
    (b, s, v), dtype = job.logits
    item = jnp.dtype(dtype).itemsize
    return LogitsLine(
        shape=(b, s, v),
        dtype=dtype,
        logits_bytes=b * s * v * item,
        f32_bytes=b * s * v * 4,
        grad_bytes=b * s * v * item,
        live_at_peak_bytes=reading.logits_live_bytes,
    )


def _xla_lines(
    job: Job,
    result: CompileResult,
    read: _Read,
    peak: int | None,
    ratio: float | None,
    policy_only: PolicyOnly | None,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(dump warnings, lines on what XLA did)``: remat, undone recompute, cost, host bytes."""
    reading = read.reading
    xla_line: tuple[str, ...] = ()
    if policy_only and peak is not None:
        xla_line = (xla_remat_line(peak, ratio, policy_only),)
    # With the pass-off compile, its line says what XLA's pass did (and more): not twice.
    dump_warnings = reading.warnings if not xla_line else tuple(
        w for w in reading.warnings if not w.startswith("XLA's rematerialisation pass recomputed")
    )  # fmt: skip
    undone = recompute_undone(job, reading)
    if undone:
        xla_line += (undone,)
    disagree = roofline.xla_disagreement(read.step_time)
    if disagree:
        xla_line += (disagree,)
    host = host_line(read.parts["host_bytes"] or 0, job.offloaded_bytes, None)
    if host:  # the compiled host figure is not the jaxpr's: the buffer assignment says why
        xla_line += (host_line(read.parts["host_bytes"], job.offloaded_bytes,
                               host_buffers(result.dump)),)  # fmt: skip
    return dump_warnings, xla_line


def note_policy_effect(job: Job, spec: Any, target: T.Target) -> Job:
    """Note on a job what its policy runs as (:func:`remat_kit.policies.policy_effect`), and
    when ``target`` does not offload."""
    effect = policy_effect(spec)
    if not effect.as_named:
        job.runs_as = effect.runs_as
        job.notes = (effect.line(), *job.notes)
    if spec.offloads and not target.supports_host_offload:
        job.notes = (
            *job.notes,
            f"target {target.name!r} does not offload: the tensors this policy offloads are "
            "counted as device memory (host_bytes is 0)",
        )
    return job


def has_twin(spec: Any, target: T.Target, compare_offload: bool) -> bool:
    """Whether a policy's job gets an on-device twin (:func:`offload_twin_jobs`): it offloads
    as named, ``target`` offloads, and ``compare_offload``."""
    return bool(
        compare_offload
        and target.supports_host_offload
        and spec.offloads
        and policy_effect(spec).as_named
    )


def offload_twin_jobs(
    jobs: Sequence[Job],
    specs: Sequence[Any],
    target: T.Target,
    compare_offload: bool,
    make_job: Callable[[Any], Job],
) -> Iterator[Job]:
    """Hidden on-device twin jobs (:func:`remat_kit.policies.on_device_twin`) of offloading
    policies where :func:`has_twin`, linked from each policy's job, run after ``jobs``."""
    index = len(jobs)
    for job, spec in zip(jobs, specs, strict=True):
        if has_twin(spec, target, compare_offload):
            job.on_device_twin = index
            index += 1
            yield make_job(on_device_twin(spec))


def _with_twin(report: MemoryReport, twin: MemoryReport | CompileError | None) -> MemoryReport:
    if not isinstance(twin, MemoryReport):
        return report
    warnings = report.warnings
    if None not in (report.peak_bytes, twin.peak_bytes) and report.peak_bytes >= twin.peak_bytes:
        warnings += (
            f"offloading did not lower the device peak: {format_bytes(report.peak_bytes)} on "
            f"device (+{format_bytes(report.host_bytes)} host) against "
            f"{format_bytes(twin.peak_bytes)} keeping the same tensors on device",
        )
    return dataclasses.replace(
        report, peak_bytes_without_offload=twin.peak_bytes, warnings=warnings
    )


#: ``progress(index, total, what, stage)``, stage one of ``"tracing"``, ``"compiling"``,
#: ``"compiling (XLA's remat pass off)"``, ``"cached"``, ``"same program"``, ``"done"``
#: (compile stages from worker threads).
Progress = Callable[[int, int, str, str], None]

#: ``CompileEngine(cache=FROM_ENV)``: the compile cache the environment asks for.
FROM_ENV = "env"


@dataclasses.dataclass(frozen=True)
class _Batch:
    """One :meth:`CompileEngine.compile_all` call's state."""

    pool: ThreadPoolExecutor
    fast: bool
    executable: bool
    then: Callable[[Any, CompileResult], None] | None
    keys: list[str] = dataclasses.field(default_factory=list)
    futures: dict[str, Future] = dataclasses.field(default_factory=dict)
    by_item_key: dict[str, str] = dataclasses.field(default_factory=dict)
    pending: list[tuple[str, Any, Any, Callable, CompileResult | None]] = dataclasses.field(
        default_factory=list
    )
    #: Per program: (cache key, pass-off cache key).
    cache_keys: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    names: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Over futures and pending: the seed's callback submits too.
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)


class CompileEngine:
    """Lower in the calling thread, compile in a thread pool, once per program (target, fast
    options, sha256 of the lowered StableHLO); executables kept until :meth:`clear`. Analyzer
    and sweep share it; compiles go through :mod:`remat_kit.memory.compile_cache` unless an
    executable is asked for. A context manager (it owns a folder of GPU kernel caches).

    Args:
      workers: concurrent compiles (default :func:`default_workers`).
      cache: a :class:`~remat_kit.memory.compile_cache.CompileCache`, None, or :data:`FROM_ENV`.
      progress: see :data:`Progress`.
    """

    def __init__(
        self,
        workers: int | None = None,
        cache: CompileCache | None | str = FROM_ENV,
        progress: Progress | None = None,
    ):
        self.workers = max(1, workers or default_workers())
        self._done: dict[str, CompileResult | CompileError] = {}
        self._folder = tempfile.TemporaryDirectory(prefix="remat-kit-kernels-")
        self.cache = CompileCache.from_env() if cache == FROM_ENV else cache
        folder = None if self.cache is None else self.cache.folder
        self._caches = _KernelCaches(self._folder.name, lambda t: kernel_cache_file(t, folder))
        self._seeded = False
        self.progress = progress
        #: Compiles run by XLA (not read from the cache), pass-off compiles included.
        self.compiles = 0

    def __enter__(self) -> CompileEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Keep the kernel cache, then drop every executable and this engine's files."""
        self._caches.keep()
        self._done.clear()
        self._folder.cleanup()

    def held(self) -> frozenset[str]:
        """Keys of the programs whose executables are held."""
        return frozenset(
            k for k, r in self._done.items() if not (isinstance(r, CompileResult) and r.cached)
        )

    def executable(self, key: str | None) -> CompileResult | None:
        """The compile of program ``key`` (``program_sha256``) if its executable is held."""
        result = self._done.get(key) if key is not None else None
        held = isinstance(result, CompileResult) and not result.cached
        return result if held else None

    def clear(self) -> None:
        """Drop the executables kept so far (their device memory is freed with them)."""
        self._done.clear()

    def _tell(self, index: int, total: int, item: Any, stage: str) -> None:
        if self.progress is not None:
            self.progress(index, total, item.what, stage)

    def _compile(self, item: Any, lowered: Any, fast: bool, seeding: bool,
                 tell: Callable[[str], None], base: CompileResult | None = None,
                 then: Callable[[Any, CompileResult], None] | None = None):  # fmt: skip
        """Compile ``lowered`` (unless ``base`` is it) and its pass-off compile where asked;
        then ``then(item, result)`` in this worker."""
        try:
            opts = self._caches.options(item.target, seeding)
            result = base
            if result is None:
                tell("compiling")
                self.compiles += 1
                result = compile_with_dump(
                    lowered, item.target.platform, item.what, fast=fast, options=opts
                )
            if getattr(item, "policy_only", False) and result.policy_only is None:
                if result.xla_remat_instructions:  # XLA's own remat told apart: pass off
                    tell("compiling (XLA's remat pass off)")
                    self.compiles += 1
                add_policy_only(result, lowered, item.target.platform, item.what, fast, opts)
            if then is not None:
                then(item, result)
            tell("done")
            return result
        except CompileError as err:
            tell("done")
            return err

    def _from_cache(
        self, item: Any, lowered: Any, fast: bool, load: bool = True
    ) -> tuple[Any, tuple[str, str]]:
        """``(cached result or None, (cache key, pass-off cache key))``; a result may still lack
        its pass-off compile. ``load=False``: the keys only."""
        platform = item.target.platform
        text = lowered.as_text(debug_info=True)
        key = self.cache.key(text, item.target, compile_options(platform, fast))
        off_key = self.cache.key(
            text, item.target, compile_options(platform, fast, WITHOUT_XLA_REMAT)
        )
        hit = self.cache.load(key) if load else None
        if hit is not None and getattr(item, "policy_only", False) and hit.xla_remat_instructions:
            hit.policy_only = self.cache.load(off_key)
        return hit, (key, off_key)

    def _submit(self, batch: _Batch) -> None:
        """Submit the compiles held back for the kernel cache; empties ``batch.pending``."""
        self._seeded = self._seeded or bool(batch.futures)
        for key, item, lowered, tell, base in batch.pending:
            batch.futures[key] = batch.pool.submit(
                self._compile, item, lowered, batch.fast, False, tell, base, batch.then
            )
        batch.pending.clear()

    def compile_all(
        self,
        items: Iterable[Any],
        fast: bool = True,
        executable: bool = False,
        total: int | None = None,
        then: Callable[[Any, CompileResult], None] | None = None,
    ) -> list[tuple[str, CompileResult | CompileError]]:
        """Lower and compile every item, each program once; a generator's items are traced while
        earlier ones compile.

        Args:
          items: with ``what``, ``target``, ``lower`` and ``program_key``, e.g. :class:`Job`.
          fast: the fast code-generation options (not for a step to be timed).
          executable: the caller will run the executables.
          total: for progress (default ``len(items)``).
          then: ``then(item, result)`` in the worker after each compile not answered by the cache.

        Returns:
          ``(program key, CompileResult or CompileError)`` per item, in order (``stage="lower"``
          for one JAX could not lower).
        """
        total = len(items) if total is None else total  # type: ignore[arg-type]
        with capture_compiler_log(), ThreadPoolExecutor(max_workers=self.workers) as pool:
            batch = _Batch(pool, fast, executable, then)
            for index, item in enumerate(items):
                self._take(batch, index, item, functools.partial(self._tell, index, total, item))
            self._finish(batch)
        self._store(batch)  # the log lines are known now that the capture ended
        return [(key, self._done[key]) for key in batch.keys]

    def _take(self, batch: _Batch, index: int, item: Any, tell: Callable[[str], None]) -> None:
        """Lower item ``index`` and schedule its compile unless its program is known."""
        if item.program_key is not None and item.program_key in batch.by_item_key:
            batch.keys.append(batch.by_item_key[item.program_key])
            tell("same program")
            return
        tell("tracing")
        try:
            lowered = lower_for(item)
        except CompileError as err:  # reported as this item's result, as XLA's are
            key = hashlib.sha256(f"lower\n{index}\n{err}".encode()).hexdigest()
            self._done[key] = err
            lowered = None
        else:
            text = f"{T.compile_identity(item.target)}\n{batch.fast}\n{lowered.as_text()}"
            key = hashlib.sha256(text.encode()).hexdigest()
            batch.names.setdefault(key, item.what)
        batch.keys.append(key)
        if item.program_key is not None:
            batch.by_item_key[item.program_key] = key
        if lowered is None:
            tell("done")
            return
        if self._known(batch, key):
            tell("same program")
            return
        base = self._cached(batch, key, item, lowered)
        wants_off = getattr(item, "policy_only", False)
        if base is not None and (
            not wants_off or not base.xla_remat_instructions or base.policy_only
        ):
            self._done[key] = base
            tell("cached")
            return
        self._schedule(batch, key, item, lowered, tell, base)

    def _known(self, batch: _Batch, key: str) -> bool:
        """Whether program ``key`` is compiled, under way or held back."""
        held = self._done.get(key)
        if batch.executable and isinstance(held, CompileResult) and held.cached:
            held = None  # read from the cache: no executable to run
        with batch.lock:
            seen = key in batch.futures or any(key == k for k, *_ in batch.pending)
        return held is not None or seen

    def _cached(self, batch: _Batch, key: str, item: Any, lowered: Any) -> CompileResult | None:
        """The compile cache's result for ``key`` or None, noting its keys for :meth:`_store`."""
        if self.cache is None:
            return None
        base, batch.cache_keys[key] = self._from_cache(
            item, lowered, batch.fast, not batch.executable
        )
        return base

    def _schedule(self, batch: _Batch, key: str, item: Any, lowered: Any,
                  tell: Callable[[str], None], base: CompileResult | None) -> None:  # fmt: skip
        """Submit ``key``'s compile; on a GPU others wait for the first (the kernel cache)."""
        with batch.lock:
            seeding = not self._seeded and item.target.platform == "cuda"  # a cache to fill
            if seeding and batch.futures:  # the seed is under way: compile after it
                batch.pending.append((key, item, lowered, tell, base))
                return
            batch.futures[key] = batch.pool.submit(
                self._compile, item, lowered, batch.fast, seeding, tell, base, batch.then
            )
            if seeding:
                batch.futures[key].add_done_callback(functools.partial(self._release, batch))

    def _release(self, batch: _Batch, _: Future) -> None:
        """Submit the held-back compiles: the first compile filled the kernel cache."""
        with batch.lock:
            self._submit(batch)

    def _finish(self, batch: _Batch) -> None:
        """Wait for the first compile, submit the ones held back, and keep every result."""
        with batch.lock:
            first = next(iter(batch.futures.values()), None)
        if first is not None:  # the held-back compiles wait for it
            first.result()
        with batch.lock:
            self._submit(batch)
            running = dict(batch.futures)
        self._done.update({key: future.result() for key, future in running.items()})

    def _store(self, batch: _Batch) -> None:
        """Write this batch's compiles (and pass-off compiles) to the compile cache."""
        if self.cache is None:
            return
        for key in batch.futures:
            result = self._done[key]
            if isinstance(result, CompileResult) and key in batch.cache_keys:
                main, off = batch.cache_keys[key]
                self.cache.store(main, result, batch.names[key])
                if result.policy_only is not None:
                    self.cache.store(off, result.policy_only, batch.names[key] + ", pass off")


@dataclasses.dataclass(frozen=True)
class Compiled:
    """The compile stage's output for one job: XLA's executable and dumps (``result``), the
    lowered program's sha256 (equal for jobs that lowered to one program: compiled once), and
    what was read from them beside the other compiles; :meth:`report` is the report stage."""

    job: Job
    result: CompileResult
    program_sha256: str
    read: _Read | None = None

    def report(self, options: ReportOptions) -> MemoryReport:
        """The job's :class:`MemoryReport` (peak, buffers, residuals, estimated step time)."""
        report = _report(self.job, self.result, options, self.read)
        return dataclasses.replace(report, program_sha256=self.program_sha256)


def compile_jobs(
    jobs: Iterable[Job],
    options: ReportOptions,
    workers: int | None = None,
    engine: CompileEngine | None = None,
    total: int | None = None,
) -> list[tuple[Job, Compiled | CompileError]]:
    """Lower and compile every job (identical programs once, ``workers`` at a time), each
    compile's dumps read in its worker: each job with its :class:`Compiled`, or with XLA's
    CompileError where it failed.

    Args:
      jobs: a sequence or generator (traced while earlier jobs compile).
      workers: concurrent compiles of a private engine (default :func:`default_workers`).
      engine: a :class:`CompileEngine` whose executables the caller keeps; None: a private one.
      total: for progress (default ``len(jobs)``).
    """
    made: list[Job] = []
    queue = iter(jobs)
    first = next(queue, None)
    if first is not None:  # a local device is calibrated (once per machine) before any compile
        calibration.device_figures(first.target)  # loads the cores: its figures are a quiet one's

    def taken() -> Iterator[Job]:
        for job in itertools.chain([first] if first is not None else [], queue):
            made.append(job)
            yield job

    reads: dict[int, _Read] = {}

    def then(job: Job, result: CompileResult) -> None:  # in the worker, beside other compiles
        reads[id(job)] = _read(job, result, options.top_k)

    total = len(jobs) if total is None else total  # type: ignore[arg-type]
    if engine is None:
        with CompileEngine(workers) as own:
            compiled = own.compile_all(taken(), options.fast_compile, total=total, then=then)
    else:
        compiled = engine.compile_all(taken(), options.fast_compile, total=total, then=then)
    return [
        (
            job,
            result
            if isinstance(result, CompileError)
            else Compiled(job, result, key, reads.get(id(job))),
        )
        for job, (key, result) in zip(made, compiled, strict=True)
    ]


def run_jobs(
    jobs: Iterable[Job],
    options: ReportOptions,
    workers: int | None = None,
    raise_errors: bool = True,
    engine: CompileEngine | None = None,
    total: int | None = None,
) -> list[MemoryReport | CompileError]:
    """Compile (:func:`compile_jobs`) and report every job, each offloading job beside its
    on-device twin and each policy against the run's no-remat step.

    Args:
      raise_errors: False: a failed job gives its CompileError.
      Others: as :func:`compile_jobs`.

    Returns:
      One report (or CompileError) per job, in order.

    Raises:
      CompileError: with ``raise_errors``, the first visible job that failed.
    """
    stages = compile_jobs(jobs, options, workers, engine, total)
    out: list[MemoryReport | CompileError] = []
    for job, stage in stages:
        if isinstance(stage, Compiled):
            out.append(stage.report(options))
            continue
        err = stage.renamed(job.what, job.policy)
        if raise_errors and job.visible:
            raise err from stage
        out.append(err)
    jobs = [job for job, _ in stages]
    for i, job in enumerate(jobs):
        if job.on_device_twin is not None and isinstance(out[i], MemoryReport):
            out[i] = _with_twin(out[i], out[job.on_device_twin])  # type: ignore[arg-type]
    _add_memory_not_freed(jobs, out)
    return out


def _add_memory_not_freed(jobs: Sequence[Job], out: list) -> None:
    """Warn where a policy's fewer residuals do not lower the temp memory of ``no-remat``
    (:func:`remat_kit.memory.undone.memory_not_freed`)."""
    bases = {
        (job.target.name, job.mesh_devices): rep
        for job, rep in zip(jobs, out, strict=True)
        if job.policy == "no-remat" and isinstance(rep, MemoryReport)
    }
    for i, job in enumerate(jobs):
        base, rep = bases.get((job.target.name, job.mesh_devices)), out[i]
        if base is None or not isinstance(rep, MemoryReport) or cse_undone(rep.warnings):
            continue
        line = memory_not_freed(job, rep, base)
        if line:
            out[i] = dataclasses.replace(rep, warnings=(*rep.warnings, line))
