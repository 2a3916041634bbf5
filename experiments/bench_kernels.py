"""The step-time model kernel by kernel: each compiled kernel's roofline time beside the time
XLA:CPU's profiler measured for it.

The sweep sets a whole step's estimate beside its measured time; where the two disagree, this
says in which kernels. For each policy it compiles a preset's train step on the local CPU (the
sweep's step: AdamW, donated state), estimates every kernel (:func:`remat_kit.memory.roofline.
executed_kernels` and :func:`~remat_kit.memory.roofline.time_kernels` with this machine's
calibration), then runs ``--steps`` steps under ``jax.profiler`` and sums, per HLO instruction
(loop bodies: every iteration), what XLA:CPU's thunk executor records for it: an event named
after the instruction while the thread that launched the kernel runs it (the ``measured``
figure), and a marker ``end: <name>`` when the kernel completes, later where its work went on
on other threads (partitioned fusions, Eigen matmuls, large copies). The kernel's own time lies
between the event and the span from its launch to its completion (``completed``), which
includes the time its work waited for a thread while other kernels ran. Per policy it reports:

- the step's wall time beside the sums of its kernels' events and spans (above the wall time
  where XLA:CPU ran kernels side by side on several cores), the time some kernel was in flight
  and the time two or more were (the union and the overlap of their spans), and the estimate;
- measured against estimated time by the term that bounds each kernel in the model (compute,
  memory, elementwise, ...): which term is mispriced; the model's allocation term has no
  kernel of its own (its page faults land in the kernels that first touch the buffer);
- the kernels whose measured time differs most from their estimate, with JAX's op name.

Command (the committed figures: ``experiments/results/cpu/kernels.md``)::

    python experiments/bench_kernels.py --seq 256 --policy no-remat --policy save-dots \
        --policy save-dots-no-batch --policy save-dots-except-mlp --out experiments/results/cpu

Runtime: about 25 s on a 2-core VM (compiles, 2 warm-up and 3 profiled steps per policy).
Hardware: the local CPU (XLA:CPU's profiler events; on a GPU its events name other things).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROG = "bench_kernels.py"
#: Kernels listed per policy, by the size of their error.
TOP = 12
#: XLA:CPU's name for the marker it records when a kernel completes.
END = "end: "


def measured_kernels(
    run_step, steps: int, names: set[str]
) -> tuple[dict[str, float], dict[str, float], float, dict[str, float]]:
    """Seconds per step XLA:CPU spent in each kernel named in ``names`` (summed over the
    threads and loop iterations), two ways, the median wall time of the profiled steps, and how
    the kernels lie in time (:func:`concurrency`, over their spans).

    XLA:CPU's thunk executor records a kernel twice: an event named after the HLO instruction
    while the thread that launched it runs it, and a marker ``"end: {name}"`` when the kernel
    completes (``ThunkExecutor::TracedExecute``). A kernel that finishes on other threads
    (a partitioned fusion's other partitions, an Eigen matmul) completes after its launch event
    ends. Returns ``(on_thread, completed, wall, concurrency)``: ``on_thread`` sums the launch
    events, ``completed`` the time from each launch to its completion (the launch's end where
    no marker was recorded); the kernel's own time lies between the two (the second includes
    the time its work waited for a thread while other kernels ran)."""
    import jax

    walls = []
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            for _ in range(steps):
                t0 = time.perf_counter()
                run_step()
                walls.append(time.perf_counter() - t0)
        finally:
            jax.profiler.stop_trace()
        (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
        launches: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
        completions: dict[str, list[int]] = collections.defaultdict(list)
        for plane in data.planes:
            for line in plane.lines:
                for event in line.events:
                    if event.name in names:
                        launches[event.name].append(
                            (event.start_ns, event.start_ns + event.duration_ns)
                        )
                    elif event.name.startswith(END) and event.name[len(END) :] in names:
                        completions[event.name[len(END) :]].append(event.start_ns)
    on_thread: dict[str, float] = {}
    completed: dict[str, float] = {}
    spans: list[tuple[int, int]] = []
    for name, events in launches.items():
        ends = kernel_spans(events, completions.get(name, []))
        on_thread[name] = sum(b - a for a, b in events) * 1e-9 / steps
        completed[name] = sum(b - a for a, b in ends) * 1e-9 / steps
        spans += ends
    side = {k: v / steps for k, v in concurrency(spans).items()}
    return on_thread, completed, statistics.median(walls), side


def kernel_spans(launches: list[tuple[int, int]], completions: list[int]) -> list[tuple[int, int]]:
    """Each execution of one kernel from its launch to its completion: the ``i``-th launch
    (in time) with the ``i``-th completion marker, never ending before the launch event does
    (a launch with no marker, cut off by the end of the trace, ends with its event)."""
    launches, completions = sorted(launches), sorted(completions)
    return [
        (start, max(end, completions[i]) if i < len(completions) else end)
        for i, (start, end) in enumerate(launches)
    ]


def concurrency(spans: list[tuple[int, int]]) -> dict[str, float]:
    """Seconds in which at least one kernel ran (``busy_s``) and in which two or more ran side
    by side on different threads (``side_by_side_s``), from ``(start_ns, end_ns)`` events."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    busy = both = 0
    running, last = 0, None
    for at, step in edges:
        if last is not None:
            busy += (at - last) if running >= 1 else 0
            both += (at - last) if running >= 2 else 0
        running, last = running + step, at
    return {"busy_s": busy * 1e-9, "side_by_side_s": both * 1e-9}


def one_policy(model: str, batch: int, seq: int, policy: str, steps: int) -> dict:
    """Compile, estimate and profile one policy's train step."""
    import jax
    import jax.numpy as jnp

    from remat_kit import targets as T
    from remat_kit.memory import calibration, hlo, roofline
    from remat_kit.memory import kernels as K
    from remat_kit.memory.reading import memory_parts
    from remat_kit.memory.roofline import fresh_bytes
    from remat_kit.models import get_config
    from remat_kit.training.step import (
        abstract_batch,
        init_train_state,
        make_optimizer,
        make_train_step,
    )

    config = dataclasses.replace(get_config(model), remat_policy=policy, scan_layers=True)
    optimizer = make_optimizer()
    state = {"s": init_train_state(config, optimizer, jax.random.key(0))}
    data = {k: jnp.zeros(v.shape, v.dtype) for k, v in abstract_batch(batch, seq).items()}
    compiled = make_train_step(config, optimizer).lower(state["s"], data).compile()
    kernels = K.executed_kernels(hlo.parse_hlo_module(compiled.as_text()))
    figures = calibration.device_figures(T.get_target("local"))
    estimate = roofline.time_kernels(
        kernels, figures, fresh_bytes(memory_parts(compiled)), top_k=len(kernels)
    )

    def run_step() -> None:
        state["s"], metrics = jax.block_until_ready(compiled(state["s"], data))

    for _ in range(2):  # warm: the first executions fault in arguments and code
        run_step()
    by_name = {t.name: t for t in estimate.top}
    measured, completed, wall, side = measured_kernels(run_step, steps, set(by_name))
    kernels_out = [
        {
            "name": t.name, "op_name": t.op_name, "count": t.count, "bound": t.bound,
            "predicted_s": t.time_s, "measured_s": measured.get(t.name),
            "completed_s": completed.get(t.name),
        }
        for t in estimate.top
    ]  # fmt: skip
    return {
        "policy": policy, "seq": seq, "step_s": wall, "predicted_step_s": estimate.step_time_s,
        "predicted_allocation_s": estimate.allocation_s,
        "measured_kernels_s": sum(measured.values()),
        "completed_kernels_s": sum(completed.values()), **side, "kernels": kernels_out,
    }  # fmt: skip


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        f"**{result['model']}, batch {result['batch']}**: each kernel's estimate beside the time "
        f"XLA:CPU's profiler measured for it ({result['steps']} profiled steps, ms per step). "
        "Measured: the kernel's event on the thread that launched it, short of the kernel's "
        "time where its work went on on other threads; to completion: from the launch to the "
        "kernel's completion marker (`end: <name>`), beyond its time where its work waited for "
        "a thread while other kernels ran. A kernel's own time lies between the two.",
        "",
    ]
    for p in result["policies"]:
        ks = [k for k in p["kernels"] if k["measured_s"] is not None]
        missing = len(p["kernels"]) - len(ks)
        lines += [
            f"*{p['policy']}, seq {p['seq']}*: step {p['step_s'] * 1e3:.0f} ms wall; its "
            f"kernels measured {p['measured_kernels_s'] * 1e3:.0f} ms on their launching "
            f"threads, {p['completed_kernels_s'] * 1e3:.0f} ms launch to completion (some kernel "
            f"was in flight during {p['busy_s'] * 1e3:.0f} ms of the step, two or more side "
            f"by side during {p['side_by_side_s'] * 1e3:.0f} ms), "
            f"estimated {sum(k['predicted_s'] for k in ks) * 1e3:.0f} ms, plus "
            f"{p['predicted_allocation_s'] * 1e3:.0f} ms of allocation: estimate "
            f"{p['predicted_step_s'] * 1e3:.0f} ms"
            + (f"; {missing} kernels without an event" if missing else ""),
            "",
            "| bound (model) | kernels | measured ms | to completion ms | estimated ms "
            "| measured / estimated |",
            "|---|--:|--:|--:|--:|--:|",
        ]
        groups: dict[str, list[dict]] = collections.defaultdict(list)
        for k in ks:
            groups[k["bound"]].append(k)
        for bound, members in sorted(
            groups.items(), key=lambda g: -sum(k["measured_s"] for k in g[1])
        ):
            m = sum(k["measured_s"] for k in members)
            t = sum(k["completed_s"] for k in members)
            e = sum(k["predicted_s"] for k in members)
            lines.append(
                f"| {bound} | {len(members)} | {m * 1e3:.1f} | {t * 1e3:.1f} | {e * 1e3:.1f} | "
                + (f"{m / e:.2f} |" if e > 0 else "null |")
            )
        lines += [
            "",
            "| kernel | op (JAX) | runs | bound | measured ms | to completion ms | estimated ms "
            "| difference |",
            "|---|---|--:|---|--:|--:|--:|--:|",
        ]
        worst = sorted(ks, key=lambda k: -abs(k["measured_s"] - k["predicted_s"]))[:TOP]
        for k in worst:
            op = (k["op_name"] or "").split("/")[-2:]
            lines.append(
                f"| {k['name']} | {'/'.join(op)} | {k['count']} | {k['bound']} | "
                f"{k['measured_s'] * 1e3:.2f} | {k['completed_s'] * 1e3:.2f} | "
                f"{k['predicted_s'] * 1e3:.2f} | "
                f"{(k['measured_s'] - k['predicted_s']) * 1e3:+.2f} |"
            )
        lines.append("")
    lines += [
        f"{env['cpu_count']}-core {env['cpu_model']} ({env['backend']} backend), jax {env['jax']}."
        f" Command: `{result['command']}`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-10m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--policy", action="append", help="repeatable (default: no-remat, save-dots)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps per policy")
    p.add_argument("--out", type=Path, default=None, help="folder for kernels.{json,md}")
    args = p.parse_args(argv)

    import jax

    from remat_kit.models import preset_names
    from remat_kit.policies import policy_names
    from remat_kit.sweep.results import environment

    if jax.default_backend() != "cpu":
        print(
            f"{PROG}: error: needs the CPU backend, got {jax.default_backend()!r}", file=sys.stderr
        )
        return 2
    policies = args.policy or ["no-remat", "save-dots"]
    for name, valid in ((args.model, preset_names()), *((q, policy_names()) for q in policies)):
        if name not in valid:
            print(f"{PROG}: error: unknown {name!r}; valid: {', '.join(valid)}", file=sys.stderr)
            return 2
    results = []
    for policy in policies:
        results.append(one_policy(args.model, args.batch, args.seq, policy, args.steps))
        print(f"done: {policy}", flush=True)
    result = {
        "command": "python experiments/bench_kernels.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model, "batch": args.batch, "steps": args.steps,
        "environment": environment(), "policies": results,
    }  # fmt: skip
    md = markdown(result)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "kernels.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
