"""Device figures for the step-time model: from the datasheet, or timed on the local device.

A GPU or TPU target's :class:`~remat_kit.memory.roofline.DeviceFigures` come from its
:class:`~remat_kit.targets.Target` fields (vendor figures, cited there). The local device has no
datasheet here (a CPU's peak depends on its cores, clock, vector width and the libraries XLA
calls), so :func:`calibrate` times six micro-kernels through JAX itself, each compiled by the
same XLA backend as the steps it will judge:

- a ``[1024, 1024] @ [1024, 1024]`` matmul per dtype (f32; bf16 too), FLOP/s;
- attention's two batched matmuls per dtype, ``[32, 256, 64] @ [32, 64, 256]`` (scores) and
  ``[32, 256, 256] @ [32, 256, 64]`` (context), FLOP/s of both over their time: many small
  matmuls in one kernel run well below a large GEMM's rate on a CPU (measured here, 2-core
  Intel Xeon, jax 0.10.2: 48-60 GFLOP/s against 194 for the ``[1024, 1024]`` GEMM);
- ``x * a + b`` over a 256 MiB float32 array (far past any cache), bytes read + written per s;
- the same over a 1 MiB array repeated in a ``fori_loop`` (a cache-resident re-read);
- a chain of 32 multiply-adds per element of a cache-resident array (elementwise op/s);
- ``tanh`` over the same array (transcendental op/s);
- a ``fori_loop`` of 2,000 iterations whose body is two tiny kernels (seconds per kernel);
- the 256 MiB array's ``x * a + b`` into a fresh output against the same in place (donated):
  the difference is the cost of faulting a fresh allocation's pages in, which XLA:CPU pays
  for a step's temp and output buffers at every execution (bytes per second).

Each figure is the best of a few runs (the least disturbed by other work on the machine). The
figures are cached per machine (platform, device kind, CPU model, core count, jax and jaxlib
versions) in ``calibration/`` of remat-kit's cache folder (:func:`cache_dir`); delete the
file, or pass ``refresh=True``, to time again. A calibration takes a few seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform as _platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

from remat_kit import files
from remat_kit import targets as T
from remat_kit.memory import compile_cache
from remat_kit.memory.roofline import DeviceFigures

#: Environment variable naming a calibration file to use instead of timing this machine (the
#: JSON :func:`calibrate` writes: ``{"figures": {...}, "when": ...}``): figures measured once
#: on a quiet machine, or fixed ones for reproducible tests.
CALIBRATION_ENV = "REMAT_KIT_CALIBRATION"

#: Version of the calibration's file format and micro-kernels (a change re-times).
CALIBRATION_VERSION = 3

#: Issue rate of the special-function units per SM per clock for 32-bit transcendental
#: instructions on compute capability 8.x and 9.0 (CUDA C++ Programming Guide, "Arithmetic
#: Instructions" throughput table).
_SFU_PER_SM_PER_CLOCK = 16
#: Launch cost of one GPU kernel: a few microseconds back to back (NVIDIA Developer Blog,
#: "Getting Started with CUDA Graphs", 2019, measured ~3 us per short kernel without graphs).
#: An assumption until the GPU check calibrates it on a real H200.
GPU_LAUNCH_S = 3e-6
#: Fixed cost per HLO kernel on a TPU, where the whole step runs as one program on the chip
#: (no host launch per kernel): an assumption of 1 us (pipeline fill and sync between fused
#: ops), no published figure.
TPU_OP_S = 1e-6


def cache_dir() -> Path:
    """remat-kit's cache folder (:func:`remat_kit.memory.compile_cache.default_folder`:
    ``$REMAT_KIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/remat-kit``, else ``~/.cache/remat-kit``);
    calibrations go in its ``calibration/`` folder."""
    return compile_cache.default_folder()


def datasheet_figures(target: T.Target) -> DeviceFigures | None:
    """Figures of a GPU or TPU target from its vendor figures; None where the target lacks a
    peak FLOP/s or memory bandwidth (the CPU, an unknown local device).

    Elementwise rate: FP32 lanes x SMs x boost clock (one operation per lane per clock);
    transcendental rate: 16 per SM per clock (see :data:`_SFU_PER_SM_PER_CLOCK`). The GPU's L2
    bandwidth is not published: every byte is costed at HBM bandwidth (``cache_bytes=0``).
    A TPU target without a ``gpu`` spec takes its vector rate as a tenth of its matmul peak
    (its VPU's share; an assumption, stated in ``source``).
    """
    if not target.peak_flops_bf16 or not target.hbm_bytes_per_s:
        return None
    gpu = target.gpu
    f32 = target.peak_flops_f32 or target.peak_flops_bf16
    if gpu is not None:
        clock = gpu.clock_rate_ghz * 1e9
        elementwise = gpu.core_count * gpu.fpus_per_core * clock
        transcendental = gpu.core_count * _SFU_PER_SM_PER_CLOCK * clock
        vector_source = (
            f"elementwise {elementwise / 1e12:.1f} Top/s = {gpu.core_count} SMs x "
            f"{gpu.fpus_per_core} FP32 lanes x {gpu.clock_rate_ghz} GHz; transcendental "
            f"{transcendental / 1e12:.2f} Top/s = 16/SM/clock (CUDA C++ Programming Guide)"
        )
    else:
        elementwise = target.peak_flops_bf16 / 10
        transcendental = elementwise / 4
        vector_source = "vector units assumed at 1/10 of the matmul peak (no published figure)"
    if target.launch_s is not None:
        launch, launch_note = target.launch_s, ""
    elif target.platform == "tpu":  # one program on the chip, no host launch per kernel
        launch, launch_note = TPU_OP_S, " (assumed: no published per-op figure for TPUs)"
    else:
        launch, launch_note = GPU_LAUNCH_S, " (assumed: NVIDIA blog, CUDA Graphs)"
    return DeviceFigures(
        name=target.name,
        peak_flops={"bf16": target.peak_flops_bf16, "f32": f32, "f16": target.peak_flops_bf16},
        memory_bytes_per_s=target.hbm_bytes_per_s,
        cache_bytes=0,
        cache_bytes_per_s=target.hbm_bytes_per_s,
        elementwise_per_s=elementwise,
        transcendental_per_s=transcendental,
        launch_s=launch,
        host_link_bytes_per_s=target.host_link_bytes_per_s,
        interconnect_bytes_per_s=target.interconnect_bytes_per_s,
        source=(
            f"datasheet: {target.source}; {vector_source}; launch {launch * 1e6:.1f} us"
            + launch_note
        ),
    )


def machine_key() -> dict[str, str]:
    """What the local figures depend on: platform, device kind, CPU model, cores, versions."""
    import jax
    import jaxlib

    dev = jax.devices()[0]
    cpu_model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        cpu_model = _platform.processor()
    return {
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "cpu_model": cpu_model,
        "cpu_count": str(os.cpu_count()),
        "machine": _platform.machine(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "version": str(CALIBRATION_VERSION),
    }


def _best_of(fn: Callable[[], object], runs: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile + warm
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def measure(runs: int = 5) -> dict[str, float]:
    """Time the micro-kernels on JAX's default device (see the module docstring).

    Returns rates per second, ``cache_bytes`` and ``launch_s``.
    """
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    out: dict[str, float] = {}
    n = 1024
    for dtype, name in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16")):
        a = jax.random.normal(key, (n, n), dtype)
        b = jax.random.normal(key, (n, n), dtype)
        mm = jax.jit(lambda x, y: x @ y)
        out[f"peak_flops_{name}"] = 2 * n**3 / _best_of(lambda mm=mm, a=a, b=b: mm(a, b), runs)
        heads, seq, dim = 32, 256, 64
        q = jax.random.normal(key, (heads, seq, dim), dtype)
        kt = jax.random.normal(key, (heads, dim, seq), dtype)
        p = jax.random.normal(key, (heads, seq, seq), dtype)
        bmm = jax.jit(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y))
        t_scores = _best_of(lambda bmm=bmm, q=q, kt=kt: bmm(q, kt), runs)
        t_context = _best_of(lambda bmm=bmm, p=p, q=q: bmm(p, q), runs)
        out[f"batched_flops_{name}"] = 2 * 2 * heads * seq * seq * dim / (t_scores + t_context)

    nbytes = 256 * 2**20
    state = {"x": jnp.ones((nbytes // 4,), jnp.float32)}
    axpb = jax.jit(lambda x: x * 1.0001 + 0.5)
    t_fresh = _best_of(lambda: axpb(state["x"]), max(2, runs // 2))
    # The same in place (the input donated): no fresh output buffer to fault in.
    inplace = jax.jit(lambda x: x * 1.0001 + 0.5, donate_argnums=0)

    def step():
        state["x"] = inplace(state["x"])
        return state["x"]

    t_inplace = _best_of(step, max(2, runs // 2))
    state.clear()
    out["memory_bytes_per_s"] = 2 * nbytes / t_inplace
    # What a fresh 256 MiB output costs beyond the same work in place: faulting its pages in.
    out["fresh_bytes_per_s"] = nbytes / max(t_fresh - t_inplace, 1e-9)

    def loop(k):
        return jax.jit(lambda x: jax.lax.fori_loop(0, k, lambda i, v: v * 1.0001 + 0.5, x))

    # Launch: a loop whose body is two tiny kernels (an [8, 8] matmul and an add), so each
    # iteration dispatches real kernels (XLA compiles a purely elementwise loop into one).
    def tiny_loop(k):
        def body(i, v):
            return jnp.tanh(v @ v) + 0.5

        return jax.jit(lambda x: jax.lax.fori_loop(0, k, body, x))

    iters = 2000
    tiny = jnp.eye(8, dtype=jnp.float32)
    long_loop, one = tiny_loop(iters), tiny_loop(1)
    t_loop = _best_of(lambda: long_loop(tiny), runs)
    t_one = _best_of(lambda: one(tiny), runs)
    out["launch_s"] = max((t_loop - t_one) / (iters - 1) / 2, 1e-9)

    # Cache: 1 MiB re-read 200 times (fits any L2/LLC); the loop's launch cost taken out.
    small = jnp.ones((2**18,), jnp.float32)
    reps = 200
    cached = loop(reps)
    t_small = _best_of(lambda: cached(small), runs)
    per = max(t_small / reps - out["launch_s"], 1e-9)
    out["cache_bytes_per_s"] = 2 * small.nbytes / per

    # Elementwise: 32 dependent multiply-adds per element of a cache-resident array.
    mid = jnp.ones((2**20,), jnp.float32)  # 4 MiB

    def chain(x):
        for i in range(32):
            x = x * 1.0001 + (0.5 + i)
        return x

    chained, tanh = jax.jit(chain), jax.jit(jnp.tanh)
    t_chain = _best_of(lambda: chained(mid), runs)
    out["elementwise_per_s"] = 64 * mid.size / t_chain  # mul and add each one operation
    t_tanh = _best_of(lambda: tanh(mid), runs)
    # tanh's own bytes are small beside its arithmetic on a CPU; take the bytes' time out.
    t_tanh_ops = max(t_tanh - 2 * mid.nbytes / out["cache_bytes_per_s"], t_tanh / 4)
    out["transcendental_per_s"] = mid.size / t_tanh_ops
    out["cache_bytes"] = float(_last_level_cache_bytes() or 0)
    return out


def _last_level_cache_bytes() -> int | None:
    """The largest CPU cache (L3 on most machines), from sysfs; None if unknown."""
    best = None
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in base.glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        value = int(size.rstrip("KMG")) * mult
        best = max(best or 0, value)
    return best


#: Held while a calibration is read or timed: two timed at once would each see a loaded machine.
_CALIBRATING = threading.Lock()


def calibrate(refresh: bool = False, runs: int = 5) -> DeviceFigures:
    """Figures for JAX's default device, timed here once per machine and cached.

    Args:
      refresh: time again even when a cached calibration exists.
      runs: timed runs per micro-kernel (the best is kept).

    Returns:
      :class:`DeviceFigures` with ``measured=True``; ``source`` names the machine and the date
      the figures were timed.
    """
    with _CALIBRATING:  # threads asking at once: one times the machine, the others read it
        return _calibrate(refresh, runs)


def _calibrate(refresh: bool, runs: int) -> DeviceFigures:
    key = machine_key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "calibration" / f"{digest}.json"
    given = os.environ.get(CALIBRATION_ENV)
    data = None
    if given:  # figures fixed by the user (or the tests): used as they are, never re-timed
        data = json.loads(Path(given).read_text())
        data["key"] = key
        data["when"] = f"{data.get('when', 'unknown date')}, read from ${CALIBRATION_ENV}={given}"
    elif path.exists() and not refresh:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            data = None
    if data is None or data.get("key") != key:
        figures = measure(runs)
        data = {
            "key": key,
            "figures": figures,
            "when": f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
            f"{os.getloadavg()[0]:.2f}",
        }
        files.write_text(path, json.dumps(data, indent=1))
    f = data["figures"]
    return DeviceFigures(
        name=f"local {key['platform']} ({key['cpu_model'] or key['device_kind']})",
        peak_flops={"f32": f["peak_flops_f32"], "bf16": f["peak_flops_bf16"]},
        batched_flops=(  # absent from a figures file written before version 3
            {"f32": f["batched_flops_f32"], "bf16": f["batched_flops_bf16"]}
            if "batched_flops_f32" in f
            else None
        ),
        memory_bytes_per_s=f["memory_bytes_per_s"],
        cache_bytes=int(f["cache_bytes"]),
        cache_bytes_per_s=f["cache_bytes_per_s"],
        elementwise_per_s=f["elementwise_per_s"],
        transcendental_per_s=f["transcendental_per_s"],
        launch_s=f["launch_s"],
        host_link_bytes_per_s=None,
        interconnect_bytes_per_s=None,
        fresh_bytes_per_s=f["fresh_bytes_per_s"] if key["platform"] == "cpu" else None,
        source=(
            f"calibrated on this machine {data['when']} (jax {key['jax']}, {key['cpu_count']} "
            f"cores): {', '.join(f'{k}={v:.4g}' for k, v in sorted(f.items()))}"
        ),
        measured=True,
    )


def device_figures(target: T.Target) -> DeviceFigures | None:
    """The figures the time model uses for ``target``: the datasheet's for a GPU or TPU model
    compiled deviceless, the calibration's for the local device (a local GPU of a known model
    is calibrated too: what this machine does beats what the datasheet says). None when
    neither is available (a CPU target while JAX's default device is not a CPU)."""
    import jax

    if not target.deviceless and target.platform == jax.devices()[0].platform:
        return calibrate()
    return datasheet_figures(target)


__all__ = [
    "calibrate",
    "cache_dir",
    "datasheet_figures",
    "device_figures",
    "machine_key",
    "measure",
]


def figures_for(target: T.Target) -> DeviceFigures:
    """The device figures to time steps on ``target`` with (datasheet or calibration), or an error.

    Raises:
      ValueError: the target has no figures (no peak FLOP/s or bandwidth, and it is not the
        local device, which would be calibrated).
    """
    figures = device_figures(target)
    if figures is None:
        timed = [T.LOCAL] + [n for n in T.target_names() if datasheet_figures(T.get_target(n))]
        raise ValueError(
            f"target {target.name!r} has no peak FLOP/s or memory bandwidth to time steps "
            f"with (and is not the local device, which is calibrated); pick one of "
            f"{', '.join(timed)}"
        )
    return figures


def time_model_note(target: T.Target) -> str:
    """The note every recommendation carries about the time model and its limits."""
    figures = device_figures(target)
    where = (
        "device figures calibrated on this machine"
        if figures is not None and figures.measured
        else "datasheet device figures"
    )
    return (
        f"step time = roofline over the compiled kernels on {target.name} ({where}): each "
        "kernel's matmul, memory and elementwise time, whichever is largest, plus launches and "
        "the host transfers and collectives the schedule cannot hide; it leaves out kernels "
        "running concurrently, caches beyond one level and latency-bound kernels: an estimate "
        "to rank by, not a measurement"
    )
