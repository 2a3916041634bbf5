"""Where the seconds of ``remat-kit analyze`` go, per policy and per stage (issue 29).

Command (CPU machine; GPU targets compile deviceless with the CUDA plugin)::

    JAX_PLATFORMS=cpu python experiments/bench_speed.py                    # profile, ~1-2 min
    JAX_PLATFORMS=cpu python experiments/bench_speed.py --model tiny-gpt --batch 2 --seq 64
    JAX_PLATFORMS=cpu python experiments/bench_speed.py --cli              # first run + repeat
    JAX_PLATFORMS=cpu python experiments/bench_speed.py --cli --no-cache   # cache off

The profile runs ``analyze_policies`` in this process (llama3-8b b=1 s=8192 on h100-sxm, every
registered policy, by default), with timers wrapped around each stage of the pipeline:

- ``setup``: the abstract train state, shardings and target topology (once);
- ``baseline``: the no-remat step traced for the FLOPs baseline (once);
- ``residuals``: the residual table (one block traced per policy for a preset);
- ``trace``: JAX tracing the train step to a jaxpr (``jit(...).trace``);
- ``lower``: jaxpr -> StableHLO (``Traced.lower``), and the program fingerprint (``as_text``);
- ``compile``: XLA's passes, buffer assignment and code generation, with the dumps written;
- ``dump``: reading the dump files back;
- ``pass-off``: the second compile with XLA's rematerialisation pass off (where it fired);
- ``read``: parsing the dumps into the report (FLOPs, buffers at peak, timeline).
- ``cache``: reading or writing the persistent compile cache.

Each stage is timed in wall seconds and in CPU seconds of the thread that ran it (compiles run
in a worker thread while the next policy is traced, so wall seconds of different stages overlap;
XLA may use more threads of its own, which thread CPU time does not see: the whole process's CPU
time is printed too). The machine is shared: the load average is printed before and after.

``--cli`` times the command end to end in fresh processes instead (wall and CPU seconds of the
child): a first run with an empty cache folder, then a repeat reading it; it checks that the two
runs give the same figures (peak, host bytes, both recompute ratios) and, with ``--compare
FILE``, the same as an earlier ``--json`` output (e.g. from before a change).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("setup", "baseline", "residuals", "trace", "lower", "compile", "dump", "pass-off",
          "read", "cache")  # fmt: skip
#: The figures a repeat (cache) or a faster pipeline must leave unchanged.
FIGURES = ("peak_bytes", "host_bytes", "recompute_ratio", "compiled_recompute_ratio", "flops",
           "temp_bytes", "argument_bytes", "output_bytes", "alias_bytes",
           "peak_bytes_without_offload", "activation_bytes")  # fmt: skip


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Timers:
    """Wall and thread-CPU seconds per (policy, stage), from any thread."""

    def __init__(self):
        self.rows: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0, 0])
        self.lock = threading.Lock()
        self.local = threading.local()

    @contextlib.contextmanager
    def stage(self, stage: str, policy: str | None = None):
        policy = policy or getattr(self.local, "policy", None) or "(all)"
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            w, c = time.perf_counter() - w0, time.thread_time() - c0
            with self.lock:
                row = self.rows[(policy, stage)]
                row[0] += w
                row[1] += c
                row[2] += 1

    def wrap(self, stage: str, fn, policy_of=None):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            policy = policy_of(*args, **kwargs) if policy_of else None
            with self.stage(stage, policy):
                return fn(*args, **kwargs)

        return wrapped


def _policy_of_what(what: str) -> str:
    # "policy 'save-dots' on target 'h100-sxm'" -> "save-dots"
    return what.split("'")[1] if what.startswith("policy '") else what


def instrument(timers: Timers) -> None:
    """Wrap the pipeline's stages with timers (monkeypatching: this script only)."""
    import jax._src.stages as jstages

    from remat_kit.memory import api, hlo, runner, xla_compile

    # tracing vs lowering: Jitted.lower = trace(...).lower()
    traced_lower = jstages.Traced.lower
    jstages.Traced.lower = timers.wrap("lower", traced_lower)
    jstages.Lowered.as_text = timers.wrap("lower", jstages.Lowered.as_text)

    from remat_kit import zoo as P

    api.trace.trace_program = timers.wrap("setup", api.trace.trace_program)  # tags, reach, baseline
    P.model_residuals = timers.wrap(
        "residuals", P.model_residuals,
        lambda config, *a, **k: config.policy_spec.name,
    )  # fmt: skip

    make_job = api._program_job

    def model_job(setup, spec, visible=True):
        timers.local.policy = spec.name
        job = make_job(setup, spec, visible)
        lower = job.lower

        def timed_lower():  # trace + lower; Traced.lower's own timer gives "lower"
            timers.local.policy = job.policy  # also for as_text (the fingerprint) after it
            with timers.stage("trace", job.policy):
                return lower()

        job.lower = timed_lower
        timers.local.policy = None
        return job

    api._program_job = model_job

    compile_with_dump = xla_compile.compile_with_dump

    def timed_compile(lowered, platform, what, fast=True, options=None):
        stage = "pass-off" if options and "xla_disable_hlo_passes" in options else "compile"
        with timers.stage(stage, _policy_of_what(what)):
            return compile_with_dump(lowered, platform, what, fast, options)

    xla_compile.compile_with_dump = timed_compile
    runner.compile_with_dump = timed_compile
    hlo.read_dump = timers.wrap("dump", hlo.read_dump)  # xla_compile calls hlo.read_dump

    report = runner._report

    def timed_report(job, *rest):  # (job, result, options, read): runner._report's
        with timers.stage("read", job.policy):
            return report(job, *rest)

    runner._report = timed_report
    cache = sys.modules.get("remat_kit.memory.compile_cache")
    if cache is not None:
        for name in ("load", "store"):
            if hasattr(cache.CompileCache, name):
                setattr(cache.CompileCache, name,
                        timers.wrap("cache", getattr(cache.CompileCache, name)))  # fmt: skip


def _fix_trace(timers: Timers) -> None:
    """``trace`` was timed with ``lower`` inside: take it out."""
    for (policy, stage), row in list(timers.rows.items()):
        if stage == "trace":
            lw = timers.rows.get((policy, "lower"), [0, 0, 0])
            row[0] = max(0.0, row[0] - lw[0])
            row[1] = max(0.0, row[1] - lw[1])


def profile(args) -> None:
    import jax

    import remat_kit  # noqa: F401  (registers everything)

    with contextlib.suppress(ImportError):
        from remat_kit.memory import compile_cache  # noqa: F401
    from remat_kit import preset
    from remat_kit.memory.api import analyze_policies
    from remat_kit.policies import policy_names

    timers = Timers()
    instrument(timers)
    policies = args.policy or policy_names()
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, load before: {_load()}", flush=True)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    reports = analyze_policies(
        preset(args.model, args.batch, args.seq), policies, target=args.target,
        raise_errors=False, workers=args.workers,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    _fix_trace(timers)
    names = list(dict.fromkeys([*policies, *(p for p, _ in timers.rows)]))
    print(
        f"\n{args.model} b={args.batch} s={args.seq} on {args.target}, {len(policies)} policies: "
        f"{wall:.1f} s wall, {cpu:.1f} s CPU (process), load after: {_load()}\n"
        "per stage: wall s / thread-CPU s (count where > 1)"
    )
    head = f"{'policy':24s}" + "".join(f"{s:>15s}" for s in STAGES)
    print(head)
    totals = collections.defaultdict(lambda: [0.0, 0.0])
    for name in names:
        cells = []
        for s in STAGES:
            row = timers.rows.get((name, s))
            if row is None or row[2] == 0:
                cells.append(f"{'':>15s}")
                continue
            totals[s][0] += row[0]
            totals[s][1] += row[1]
            n = f"x{row[2]}" if row[2] > 1 else ""
            cells.append(f"{row[0]:6.2f}/{row[1]:5.2f}{n:>3s}")
        if any(c.strip() for c in cells):
            print(f"{name[:24]:24s}" + "".join(cells))
    print(f"{'total':24s}" + "".join(f"{totals[s][0]:7.2f}/{totals[s][1]:6.2f}" for s in STAGES))
    failed = [r for r in reports if not hasattr(r, "peak_bytes")]
    if failed:
        print(f"{len(failed)} compile(s) failed: {failed[0]}")


def _cli(extra: list[str], env: dict) -> tuple[dict, float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "remat_kit.cli", *extra, "--json"], cwd=REPO, env=env,
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"CLI failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(proc.stdout), wall, cpu, proc.stderr


def figures(out: dict) -> dict:
    """The figures of each report of a ``--json`` output, by policy."""
    return {r["policy"]: {k: r.get(k) for k in FIGURES} for r in out["reports"]}


def diff(a: dict, b: dict) -> list[str]:
    lines = []
    for policy in sorted(set(a) | set(b)):
        fa, fb = a.get(policy), b.get(policy)
        if fa != fb:
            lines.append(f"{policy}: {fa} != {fb}")
    return lines


def cli(args) -> None:
    cmd = ["analyze", "--model", args.model, "--target", args.target]
    if args.model_is_preset:
        cmd += ["--batch", str(args.batch), "--seq", str(args.seq)]
    cmd += [x for p in args.policy for x in ("--policy", p)] if args.policy else (
        ["--all-policies"] if args.model_is_preset else []
    )  # fmt: skip
    with (
        contextlib.nullcontext(args.cache_dir)
        if args.cache_dir
        else tempfile.TemporaryDirectory(prefix="remat-kit-bench-cache-")
    ) as folder:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
               "REMAT_KIT_CACHE_DIR": folder}  # fmt: skip
        if args.no_cache:
            env["REMAT_KIT_NO_CACHE"] = "1"
        print(f"remat-kit {' '.join(cmd)}  (cache: {'off' if args.no_cache else folder})")
        runs = []
        for label in ("first run", "repeat"):
            load = _load()
            out, wall, cpu, _ = _cli(cmd, env)
            runs.append(out)
            print(f"{label:10s} {wall:6.1f} s wall {cpu:6.1f} s CPU   load {load} -> {_load()}",
                  flush=True)  # fmt: skip
    problems = diff(figures(runs[0]), figures(runs[1]))
    print("first run and repeat: " + ("same figures" if not problems else "DIFFER"))
    for line in problems:
        print("  " + line)
    if args.compare:
        problems = diff(figures(json.loads(Path(args.compare).read_text())), figures(runs[0]))
        print(f"against {args.compare}: " + ("same figures" if not problems else "DIFFER"))
        for line in problems:
            print("  " + line)
    if args.save:
        Path(args.save).write_text(json.dumps(runs[0], indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--target", default="h100-sxm")
    parser.add_argument("--policy", action="append", default=[])
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--cli", action="store_true", help="time the CLI: first run + repeat")
    parser.add_argument("--no-cache", action="store_true", help="with --cli: cache off")
    parser.add_argument("--compare", help="with --cli: an earlier --json output to diff against")
    parser.add_argument("--save", help="with --cli: write the first run's --json output here")
    parser.add_argument("--cache-dir", help="with --cli: this cache folder (kept) instead of an "
                        "empty temporary one")  # fmt: skip
    args = parser.parse_args()
    args.model_is_preset = ":" not in args.model
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.cli:
        cli(args)
    else:
        profile(args)


if __name__ == "__main__":
    main()
