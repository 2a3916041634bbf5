"""Compile a lowered step once, with XLA's dumps and log lines captured for the report.

Some facts are only in XLA's C++ log on fd 2 (its remat pass: "Can't reduce memory use below X
by rematerialization; only reduced to Y"); :class:`capture_compiler_log` captures it and gives
each compile its own thread's lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax

from remat_kit.memory import hlo

#: Code-generation-only compiler options (LLVM / ptxas): memory figures unchanged
#: (tests/test_memory.py).
FAST_COMPILE_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True},
    # LLVM's own optimisation off too (docs/results/compiler.md: same dumps, less CPU time).
    "cuda": {
        "xla_gpu_disable_gpuasm_optimizations": True,
        "xla_backend_optimization_level": 0,
        "xla_llvm_disable_expensive_passes": True,
    },
}

#: An inert option in JAX's compilation-cache key, set per dump folder so JAX's cache never
#: returns an executable without its dumps (``jax/_src/cache_key.py`` omits ``xla_dump_to``).
CACHE_BYPASS_OPTION = "xla_gpu_dump_autotune_results_to"

# absl: "W1129 16:34:37.803546    5784 hlo_rematerialization.cc:3231] message"
_LOG_LINE = re.compile(
    r"^([IWEF])(\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d+)\s+(\d+) ([^:\]]+):\d+\] ?(.*)$"
)


@dataclasses.dataclass(frozen=True)
class LogLine:
    """One line of XLA's C++ log (glog format) captured during a compile."""

    severity: str  # I, W, E, F
    time: float  # seconds since the epoch (local time as logged)
    thread: int  # native thread id
    source: str  # "hlo_rematerialization.cc"
    message: str

    def __str__(self) -> str:
        return f"{self.source}: {self.message}"


def _parse_log(text: str) -> tuple[list[LogLine], list[str]]:
    """absl log lines (continuation lines appended to the message) and the other lines."""
    lines: list[LogLine] = []
    other: list[str] = []
    year = _dt.datetime.now().year
    for raw in text.splitlines():
        m = _LOG_LINE.match(raw)
        if m is None:
            if lines and raw.startswith((" ", "\t")):
                last = lines[-1]
                lines[-1] = dataclasses.replace(last, message=f"{last.message}\n{raw}")
            else:
                other.append(raw)
            continue
        sev, mon, day, hh, mm, ss, frac, tid, source, message = m.groups()
        try:
            stamp = _dt.datetime(year, int(mon), int(day), int(hh), int(mm), int(ss))
            t = stamp.timestamp() + float(f"0.{frac}")
        except ValueError:
            t = 0.0
        lines.append(LogLine(sev, t, int(tid), source, message))
    return lines, other


class capture_compiler_log:  # noqa: N801 (used as a context manager, like contextlib's)
    """Context manager: redirect fd 2 to a temporary file; re-entrant across threads. On exit
    absl lines are kept for :meth:`lines_for`, others written back; ``sys.stderr`` reaches the
    terminal meanwhile.
    """

    _lock = threading.Lock()
    _depth = 0
    _saved_fd: int | None = None
    _file = None
    _lines: list[LogLine] = []
    _claims: list[tuple[int, float, float]] = []
    _python_stderr: Any = None
    _own_stderr: Any = None

    def __enter__(self) -> capture_compiler_log:
        cls = type(self)
        with cls._lock:
            if cls._depth == 0:
                sys.stderr.flush()
                cls._file = tempfile.TemporaryFile(mode="w+b")
                cls._saved_fd = os.dup(2)
                os.dup2(cls._file.fileno(), 2)
                cls._lines = []
                cls._claims = []
                cls._python_stderr = None
                if _writes_to_fd2(sys.stderr):
                    cls._python_stderr = sys.stderr
                    sys.stderr = cls._own_stderr = os.fdopen(
                        os.dup(cls._saved_fd),
                        "w",
                        buffering=1,
                        encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
                        errors="backslashreplace",
                    )
            cls._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        cls = type(self)
        with cls._lock:
            cls._depth -= 1
            if cls._depth > 0:
                return
            sys.stderr.flush()
            if cls._own_stderr is not None:
                if sys.stderr is cls._own_stderr:
                    sys.stderr = cls._python_stderr
                cls._own_stderr.close()
                cls._own_stderr = cls._python_stderr = None
            os.dup2(cls._saved_fd, 2)
            os.close(cls._saved_fd)
            cls._file.seek(0)
            text = cls._file.read().decode("utf-8", "replace")
            cls._file.close()
            lines, other = _parse_log(text)
            cls._lines = lines
            unclaimed = [str_line for str_line in other]
            for line in lines:
                if not any(_claimed(line, claim) for claim in cls._claims):
                    unclaimed.append(_format(line))
            if unclaimed:
                sys.stderr.write("\n".join(unclaimed) + "\n")
                sys.stderr.flush()

    @classmethod
    def claim(cls, thread: int, start: float, end: float) -> None:
        """Mark the lines thread ``thread`` logs between ``start`` and ``end`` as a compile's."""
        with cls._lock:
            cls._claims.append((thread, start, end))

    @classmethod
    def lines_for(cls, thread: int, start: float, end: float) -> list[LogLine]:
        """Lines logged by ``thread`` between ``start`` and ``end``."""
        return [line for line in cls._lines if _claimed(line, (thread, start, end))]


def _writes_to_fd2(stream: Any) -> bool:
    """Whether ``stream`` is a file object over file descriptor 2 (not a capture in memory)."""
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


#: Seconds of slack around a compile's window (log stamps are microseconds of the same clock).
_SLACK_S = 0.01


def _claimed(line: LogLine, claim: tuple[int, float, float]) -> bool:
    thread, start, end = claim
    return line.thread == thread and start - _SLACK_S <= line.time <= end + _SLACK_S


def _format(line: LogLine) -> str:
    return f"{line.severity} [{line.thread}] {line.source}: {line.message}"


@dataclasses.dataclass
class CompileResult:
    """One compile: the executable, its memory analysis, XLA's dumps, and timing."""

    compiled: Any  # jax.stages.Compiled
    compile_s: float
    dump: hlo.DumpFiles
    thread: int
    start: float
    end: float
    #: Instructions XLA's own rematerialisation pass cloned (``fusion.3.remat``).
    xla_remat_instructions: int = 0
    #: The compile with that pass off, when asked for.
    policy_only: CompileResult | None = None
    #: Log lines known without the capture (read from the compile cache).
    logged: list[LogLine] | None = None
    #: Read from the compile cache (``compiled`` cannot run; ``compile_s`` is the original's).
    cached: bool = False
    #: What was compiled differently from what was asked, and why (:data:`TILING_FALLBACK`).
    notes: tuple[str, ...] = ()

    def log_lines(self) -> list[LogLine]:
        """The compiler log lines of this compile (call after the capture ended)."""
        if self.logged is not None:
            return list(self.logged)
        return capture_compiler_log.lines_for(self.thread, self.start, self.end)


#: XLA's words for a step that does not fit the device.
_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|Ran out of memory", re.IGNORECASE)
#: The figures XLA:TPU states when it refuses a step: "the total memory required for HLO
#: temporaries (26.05G) exceeds available HBM (15.75G)", or "Used 479.22G of 95.74G hbm".
_REFUSED_FIGURES = (
    re.compile(
        r"required for (?P<what>[^(]+?) \((?P<need>[\d.]+\w*)\) exceeds available "
        r"(?P<memory>\w+) \((?P<have>[\d.]+\w*)\)"
    ),
    re.compile(r"Used (?P<need>[\d.]+\w*) of (?P<have>[\d.]+\w*) (?P<memory>\w+)"),
)


class CompileError(RuntimeError):
    """A step failed to lower or compile.

    Attributes:
      what: what was compiled (``"policy 'save-dots' on target 'h100-sxm'"``).
      xla_message: the error's first line (with the fix, for a known cause).
      stage: ``"compile"`` (XLA), ``"build"`` (the program's family refused a change) or
        ``"lower"`` (JAX: :func:`lower_for`).
    """

    def __init__(
        self, what: str, xla_message: str, policy: str | None = None, stage: str = "compile"
    ):
        super().__init__(f"{what} failed to {stage}: {xla_message}")
        self.what = what
        self.xla_message = xla_message
        self.policy = policy
        self.stage = stage

    def renamed(self, what: str, policy: str | None) -> CompileError:
        """The same failure said of ``what`` under ``policy`` (a job sharing the program)."""
        return CompileError(what, self.xla_message, policy, self.stage)

    @property
    def out_of_memory(self) -> bool:
        """XLA:TPU refused the step as over HBM ("RESOURCE_EXHAUSTED: ... Ran out of memory")."""
        return bool(_OUT_OF_MEMORY.search(self.xla_message))

    def over_memory(self) -> str | None:
        """For :attr:`out_of_memory`, XLA's figures ("26.05G of HLO temporaries against 15.75G
        of HBM") or "XLA gave no figure"; None otherwise."""
        if not self.out_of_memory:
            return None
        for pattern in _REFUSED_FIGURES:
            m = pattern.search(self.xla_message)
            if m:
                what = m.groupdict().get("what")
                need = m["need"] + (f" of {what}" if what else "")
                return f"{need} against {m['have']} of {m['memory'].upper()}"
        return "XLA gave no figure"


#: JAX's error for a mesh built on other devices than the target's compile-only ones.
_DEVICE_MISMATCH = "incompatible devices"


def lowering_message(err: BaseException, target: str) -> str:
    """A lowering error's first line, with the fix for a known cause
    (:func:`remat_kit.targets.compile_devices`)."""
    line = first_line(err)
    if _DEVICE_MISMATCH in line:
        line += (
            f"; build the model's mesh on remat_kit.targets.compile_devices({target!r}) "
            f"(compile_devices({target!r}, n) for n devices), the devices remat-kit lowers "
            "for that target on (docs/own-model.md)"
        )
    return line


def lower_for(item: Any) -> Any:
    """``item.lower()`` for :meth:`~remat_kit.memory.runner.CompileEngine.compile_all`.

    Raises:
      CompileError: JAX could not lower the step (``stage="lower"``, :func:`lowering_message`).
    """
    try:
        return item.lower()
    except Exception as err:  # ValueError (devices), NotImplementedError (no lowering), ...
        message = lowering_message(err, item.target.name)
        raise CompileError(item.what, message, stage="lower") from err


def first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message."""
    for line in str(err).splitlines():
        if line.strip():
            return line.strip()
    return type(err).__name__


#: The compiler option that switches XLA's own rematerialisation pass off (works deviceless).
WITHOUT_XLA_REMAT = {"xla_disable_hlo_passes": "rematerialization"}
_INSTR_NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ", re.MULTILINE)


def count_xla_remat(hlo_text: str | None) -> int:
    """Instructions of an optimized HLO module cloned by XLA's rematerialisation pass."""
    return sum(hlo.is_xla_remat(n) for n in _INSTR_NAME.findall(hlo_text or ""))


#: Dump options of every analysis compile; they override a user's ``XLA_FLAGS`` dump filters
#: (e.g. MaxText's ``--xla_dump_hlo_module_re``) that would thin the dumps read.
DUMP_OPTIONS: dict[str, Any] = {
    "xla_dump_hlo_as_text": True,
    "xla_dump_hlo_module_re": ".*",
    "xla_dump_max_hlo_modules": -1,
    "xla_dump_disable_metadata": False,
    "xla_dump_hlo_pass_re": "",
}


def user_dump_flags() -> list[str]:
    """The ``--xla_dump*`` flags of ``XLA_FLAGS``."""
    return [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_dump")]


def compile_options(platform: str, fast: bool = True, options: dict | None = None) -> dict:
    """:data:`DUMP_OPTIONS`, :data:`FAST_COMPILE_OPTIONS` (with ``fast``), then ``options``."""
    opts: dict[str, Any] = dict(DUMP_OPTIONS)
    if fast:
        opts.update(FAST_COMPILE_OPTIONS.get(platform, {}))
    opts.update(options or {})
    return opts


#: Deviceless XLA:GPU sometimes finds no Triton GEMM tiling ("Couldn't find output tile sizes");
#: the compile is retried with every GEMM a cuBLAS call, and the report says so.
TILING_ERROR = "Couldn't find output tile sizes"
TILING_FALLBACK = {"xla_gpu_enable_triton_gemm": False}


def compile_with_dump(
    lowered: Any, platform: str, what: str, fast: bool = True, options: dict | None = None
) -> CompileResult:
    """``lowered.compile()`` with ``xla_dump_to`` a temporary folder; reads the dumps back.

    Log lines are kept inside :class:`capture_compiler_log`. :data:`TILING_ERROR` retries with
    :data:`TILING_FALLBACK` (noted).

    Args:
      lowered: a ``jax.stages.Lowered``.
      platform: ``"cpu"`` or ``"cuda"``.
      what: names the compile in errors.
      fast: add :data:`FAST_COMPILE_OPTIONS`.
      options: more XLA compiler options.

    Raises:
      CompileError: XLA failed; the message is ``"{what} failed to compile: {first line}"``.
    """
    try:
        return _compile_with_dump(lowered, platform, what, fast, options)
    except CompileError as err:
        fallback = {**(options or {}), **TILING_FALLBACK}
        if platform != "cuda" or TILING_ERROR not in err.xla_message or fallback == options:
            raise
        result = _compile_with_dump(lowered, platform, what, fast, fallback)
        shape = re.search(r"= (\w+\[[\d,]*\])", err.xla_message)
        dot = f"a {shape.group(1)} matmul" if shape else "a matmul"
        result.notes = (
            "compiled with xla_gpu_enable_triton_gemm=false (every matmul a cuBLAS call): XLA "
            f"found no Triton GEMM tiling for {dot} without a GPU to autotune on",
        )
        return result


def _compile_with_dump(
    lowered: Any, platform: str, what: str, fast: bool, options: dict | None
) -> CompileResult:
    with tempfile.TemporaryDirectory(prefix="remat-kit-xla-") as folder:
        opts = {"xla_dump_to": folder, **compile_options(platform, fast, options)}
        opts[CACHE_BYPASS_OPTION] = os.path.join(folder, "autotune.txt")
        thread = threading.get_native_id()
        start = time.time()
        t0 = time.perf_counter()
        try:
            with _no_persistent_cache_write():
                compiled = lowered.compile(compiler_options=opts)
        except Exception as err:  # XlaRuntimeError, ValueError, ...
            raise CompileError(what, first_line(err)) from err
        compile_s = time.perf_counter() - t0
        end = time.time()
        capture_compiler_log.claim(thread, start, end)
        dump = hlo.read_dump(Path(folder))
    result = CompileResult(compiled, compile_s, dump, thread, start, end)
    result.xla_remat_instructions = count_xla_remat(dump.hlo)
    return result


def _no_persistent_cache_write() -> Any:
    """A context (this thread) in which JAX writes no compilation-cache entry (its keys are never
    read again, :data:`CACHE_BYPASS_OPTION`); uses JAX's internal config state where present."""
    from jax._src import config as jax_config

    state = getattr(jax_config, "persistent_cache_min_compile_time_secs", None)
    return state(float("inf")) if callable(state) else contextlib.nullcontext()


def add_policy_only(
    result: CompileResult, lowered: Any, platform: str, what: str, fast: bool, options: dict
) -> CompileResult:
    """``result`` with ``policy_only`` compiled with :data:`WITHOUT_XLA_REMAT` where XLA's remat
    pass cloned instructions."""
    if result.xla_remat_instructions:
        opts = {**options, **WITHOUT_XLA_REMAT}
        try:
            result.policy_only = compile_with_dump(lowered, platform, what, fast, opts)
        except CompileError:  # the as-run figures stand alone (policy_only stays None)
            pass
    return result


def jax_backend_description(platform: str, deviceless: bool) -> str:
    """E.g. ``"XLA GPU compiler (deviceless, jax X.Y.Z)"``, the JAX in use."""
    kind = {"cpu": "XLA CPU compiler", "cuda": "XLA GPU compiler", "tpu": "XLA TPU compiler"}.get(
        platform, f"XLA {platform}"
    )
    how = "deviceless" if deviceless else "local device"
    return f"{kind} ({how}, jax {jax.__version__})"
