"""The roofline's :class:`DeviceFigures`, from the target's datasheet
(:class:`~remat_kit.targets.Target`, cited there) or timed on the local device by
:func:`calibrate` (cached per machine). Figures and sources: docs/time-model.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform as _platform
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from remat_kit import files
from remat_kit import targets as T
from remat_kit.memory import compile_cache

#: Bytes from which glibc allocates with a fresh mmap, faulted in at every step (its dynamic
#: mmap threshold ceiling on 64-bit; mallopt(3), DEFAULT_MMAP_THRESHOLD_MAX).
FRESH_ALLOCATION_MIN_BYTES = 32 * 2**20

#: Runs of the fresh-output kernel, best kept (``experiments/bench_page_faults.py``).
FRESH_RUNS = 9


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The machine's load while :func:`calibrate` timed.

    Attributes:
      others_share: share of cores (0 to 1) other processes kept busy (None: unread).
      load_average: 1-minute load average at the end (None: unknown).
      contended: ``others_share`` above :data:`CONTENDED_SHARE`: figures below an idle machine's.
    """

    others_share: float | None
    load_average: float | None
    contended: bool


@dataclasses.dataclass(frozen=True)
class DeviceFigures:
    """What the roofline needs to know about one device. Rates per second, sizes in bytes.

    Attributes:
      peak_flops: matmul peak FLOP/s by operand dtype (absent dtypes use ``"f32"``).
      memory_bytes_per_s: HBM (CPU: DRAM) bandwidth.
      cache_bytes: the re-read cache (GPU L2, CPU LLC); 0 turns the reuse model off.
      elementwise_per_s: FP32 lanes x clock. transcendental_per_s: special-function units.
      launch_s: seconds per kernel.
      host_link_bytes_per_s, interconnect_bytes_per_s: per direction, None if none or unknown.
      source: where each figure comes from. measured: timed on this machine.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes_per_s: float
    cache_bytes: int
    cache_bytes_per_s: float
    elementwise_per_s: float
    transcendental_per_s: float
    launch_s: float
    host_link_bytes_per_s: float | None
    interconnect_bytes_per_s: float | None
    source: str
    measured: bool = False
    #: Bytes/s of faulting in fresh buffers (XLA:CPU); None where buffers are reused.
    fresh_bytes_per_s: float | None = None
    #: FLOP/s of batched matmuls (attention's ``Q @ K^T``, ``P @ V``); None: :attr:`peak_flops`.
    batched_flops: dict[str, float] | None = None
    #: The machine's state while calibrated figures were timed; None for datasheet figures.
    calibration: Calibration | None = None
    #: SMs for :func:`~remat_kit.memory.roofline.gemm_efficiency`; 0: no tile costing.
    sm_count: int = 0
    #: Devices joined by :attr:`interconnect_bytes_per_s` (a GPU node); None: any number.
    node_size: int | None = None
    #: Per-device bytes/s between nodes (a GPU's NIC), None where unknown.
    network_bytes_per_s: float | None = None
    #: FLOP/s of fused (cuDNN flash) attention; None: :attr:`peak_flops`.
    attention_flops: dict[str, float] | None = None

    def matmul_peak(self, dtype: str, batched: bool = False) -> float:
        """Matmul FLOP/s for ``dtype`` operands (``batched``: :attr:`batched_flops`)."""
        if batched and self.batched_flops:
            return self.batched_flops.get(dtype) or self.batched_flops["f32"]
        return self.peak_flops.get(dtype) or self.peak_flops["f32"]


#: Environment variable naming a calibration file (:func:`calibrate`'s JSON) to use as is.
CALIBRATION_ENV = "REMAT_KIT_CALIBRATION"

#: Version of the calibration format and micro-kernels (a change re-times).
CALIBRATION_VERSION = 5

#: Issue rate of the special-function units per SM per clock for 32-bit transcendental
#: instructions on compute capability 8.x and 9.0 (CUDA C++ Programming Guide, "Arithmetic
#: Instructions" throughput table).
_SFU_PER_SM_PER_CLOCK = 16
#: GPU kernel launch, seconds: ~3 us per short kernel without graphs (NVIDIA Developer Blog,
#: "Getting Started with CUDA Graphs", 2019); an assumption until calibrated on a GPU.
GPU_LAUNCH_S = 3e-6
#: Seconds per HLO kernel on a TPU (one program on chip, no host launch): assumed, unpublished.
TPU_OP_S = 1e-6


def cache_dir() -> Path:
    """:func:`remat_kit.memory.compile_cache.default_folder`; calibrations in ``calibration/``."""
    return compile_cache.default_folder()


def datasheet_figures(target: T.Target) -> DeviceFigures | None:
    """A GPU or TPU target's datasheet figures; None without peak FLOP/s or bandwidth.

    Elementwise: FP32 lanes x SMs x boost clock; transcendental: :data:`_SFU_PER_SM_PER_CLOCK`.
    L2 bandwidth is unpublished, so ``cache_bytes=0``. A TPU's vector rate is assumed a tenth
    of its matmul peak (stated in ``source``).
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
    mm = target.matmul_efficiency or 1.0
    hbm = target.hbm_bytes_per_s * (target.memory_efficiency or 1.0)
    achieved = (
        f"; matmuls at {mm:.1%} of peak, memory at {target.memory_efficiency or 1.0:.0%} of its "
        "bandwidth (measured shares, in the datasheet source)"
    )
    return DeviceFigures(
        name=target.name,
        peak_flops={
            "bf16": target.peak_flops_bf16 * mm,
            "f32": f32 * mm,
            "f16": target.peak_flops_bf16 * mm,
        },
        memory_bytes_per_s=hbm,
        cache_bytes=0,
        cache_bytes_per_s=hbm,
        elementwise_per_s=elementwise,
        transcendental_per_s=transcendental,
        launch_s=launch,
        host_link_bytes_per_s=target.host_link_bytes_per_s,
        interconnect_bytes_per_s=target.interconnect_bytes_per_s,
        sm_count=gpu.core_count if gpu is not None else 0,
        node_size=target.node_size,
        network_bytes_per_s=target.network_bytes_per_s,
        attention_flops=(
            {
                "bf16": target.peak_flops_bf16 * target.attention_efficiency,
                "f16": target.peak_flops_bf16 * target.attention_efficiency,
            }
            if target.attention_efficiency
            else None
        ),  # fmt: skip
        source=(
            f"datasheet: {target.source}; {vector_source}; launch {launch * 1e6:.1f} us"
            + launch_note
            + achieved
        ),
    )


def cpu_model() -> str | None:
    """The CPU's model name from ``/proc/cpuinfo`` (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_key() -> dict[str, str]:
    """What the local figures depend on: platform, device kind, CPU model, cores, versions."""
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "cpu_model": cpu_model() or _platform.processor(),
        "cpu_count": str(os.cpu_count()),
        "machine": _platform.machine(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "version": str(CALIBRATION_VERSION),
    }


def _best_of(fn: Callable[[], object], runs: int) -> float:
    import jax

    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def measure(runs: int = 5) -> dict[str, float]:
    """Time the micro-kernels on JAX's default device (docs/time-model.md, "Device figures")."""
    out = _measure_matmuls(runs)
    out.update(_measure_memory(runs))
    out["launch_s"] = _measure_launch(runs)
    out["cache_bytes_per_s"] = _measure_cache(runs, out["launch_s"])
    out.update(_measure_vector(runs, out["cache_bytes_per_s"]))
    out["cache_bytes"] = float(_last_level_cache_bytes() or 0)
    return out


def _measure_matmuls(runs: int) -> dict[str, float]:
    """Matmul rates, FLOP/s per dtype: ``peak_flops_*`` from a [1024, 1024] square matmul,
    ``batched_flops_*`` from attention's two batched matmuls (32 heads, 256 tokens, dim 64)."""
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
    return out


def _measure_memory(runs: int) -> dict[str, float]:
    """``memory_bytes_per_s`` (DRAM bytes/s, a 256 MiB update in place) and
    ``fresh_bytes_per_s`` (bytes/s of a fresh output's pages faulted in, beyond that)."""
    import jax
    import jax.numpy as jnp

    nbytes = 256 * 2**20
    state = {"x": jnp.ones((nbytes // 4,), jnp.float32)}
    axpb = jax.jit(lambda x: x * 1.0001 + 0.5)
    # The most variable figure on a VM: best of FRESH_RUNS.
    t_fresh = _best_of(lambda: axpb(state["x"]), max(FRESH_RUNS, runs))
    # The same in place (the input donated): no fresh output buffer to fault in.
    inplace = jax.jit(lambda x: x * 1.0001 + 0.5, donate_argnums=0)

    def step():
        state["x"] = inplace(state["x"])
        return state["x"]

    t_inplace = _best_of(step, max(2, runs // 2))
    state.clear()
    return {
        "memory_bytes_per_s": 2 * nbytes / t_inplace,
        "fresh_bytes_per_s": nbytes / max(t_fresh - t_inplace, 1e-9),
    }


def _measure_launch(runs: int) -> float:
    """Seconds per kernel launch: 2,000 loop iterations of two tiny kernels against one."""
    import jax
    import jax.numpy as jnp

    # A matmul in the body: XLA would fuse a purely elementwise loop into one kernel.
    def tiny_loop(k):
        def body(i, v):
            return jnp.tanh(v @ v) + 0.5

        return jax.jit(lambda x: jax.lax.fori_loop(0, k, body, x))

    iters = 2000
    tiny = jnp.eye(8, dtype=jnp.float32)
    long_loop, one = tiny_loop(iters), tiny_loop(1)
    t_loop = _best_of(lambda: long_loop(tiny), runs)
    t_one = _best_of(lambda: one(tiny), runs)
    return max((t_loop - t_one) / (iters - 1) / 2, 1e-9)


def _measure_cache(runs: int, launch_s: float) -> float:
    """Cache bandwidth, bytes/s: 1 MiB re-read 200 times (fits any L2/LLC), the loop's
    ``launch_s`` (seconds per kernel) taken out."""
    import jax
    import jax.numpy as jnp

    small = jnp.ones((2**18,), jnp.float32)
    reps = 200
    cached = jax.jit(lambda x: jax.lax.fori_loop(0, reps, lambda i, v: v * 1.0001 + 0.5, x))
    t_small = _best_of(lambda: cached(small), runs)
    per = max(t_small / reps - launch_s, 1e-9)
    return 2 * small.nbytes / per


def _measure_vector(runs: int, cache_bytes_per_s: float) -> dict[str, float]:
    """``elementwise_per_s`` (operations/s: 32 dependent multiply-adds per element of a 4 MiB
    array) and ``transcendental_per_s`` (tanh/s, its bytes' time at ``cache_bytes_per_s``
    taken out)."""
    import jax
    import jax.numpy as jnp

    mid = jnp.ones((2**20,), jnp.float32)  # 4 MiB

    def chain(x):
        for i in range(32):
            x = x * 1.0001 + (0.5 + i)
        return x

    chained, tanh = jax.jit(chain), jax.jit(jnp.tanh)
    t_chain = _best_of(lambda: chained(mid), runs)
    elementwise = 64 * mid.size / t_chain  # mul and add each one operation
    t_tanh = _best_of(lambda: tanh(mid), runs)
    # tanh's own bytes are small beside its arithmetic on a CPU; take the bytes' time out.
    t_tanh_ops = max(t_tanh - 2 * mid.nbytes / cache_bytes_per_s, t_tanh / 4)
    return {"elementwise_per_s": elementwise, "transcendental_per_s": mid.size / t_tanh_ops}


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

#: Share of cores other processes used above which a calibration is *contended*
#: (docs/time-model.md, "Device figures").
CONTENDED_SHARE = 0.25
#: Seconds after which a contended calibration is re-timed when asked; the quieter is kept.
RETIME_AFTER_S = 600.0


def _busy_cpu_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (``/proc/stat`` user, nice, system, irq,
    softirq, steal); None without ``/proc/stat``."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        ticks = [int(x) for x in first[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def others_share(fn: Callable[[], Any]) -> tuple[Any, float | None]:
    """``fn()`` and the share of cores (0 to 1) other processes kept busy meanwhile: machine busy
    time less this process's, over wall time x ``os.cpu_count()`` (None: unreadable)."""
    busy0, own0, t0 = _busy_cpu_s(), time.process_time(), time.perf_counter()
    out = fn()
    busy1, own1, wall = _busy_cpu_s(), time.process_time(), time.perf_counter() - t0
    if busy0 is None or busy1 is None or wall <= 0:
        return out, None
    other = max(0.0, (busy1 - busy0) - (own1 - own0))
    return out, min(1.0, other / (wall * (os.cpu_count() or 1)))


def calibrate(refresh: bool = False, runs: int = 5) -> DeviceFigures:
    """Figures for JAX's default device, timed once per machine and cached; a contended one
    (:data:`CONTENDED_SHARE`) is re-timed after :data:`RETIME_AFTER_S`.

    Args:
      refresh: time again even when cached.
      runs: timed runs per micro-kernel (the best is kept).

    Returns:
      :class:`DeviceFigures` (``measured=True``; ``source`` names machine, date and load).
    """
    with _CALIBRATING:  # threads asking at once: one times the machine, the others read it
        return _calibrate(refresh, runs)


def _others_share_of(data: dict[str, Any]) -> float | None:
    """``data``'s others' share of cores; unread: 1.0 if the load average exceeded the cores,
    else None."""
    share = data.get("others_share")
    if share is not None:
        return float(share)
    load = data.get("load_average")
    cores = int((data.get("key") or {}).get("cpu_count") or os.cpu_count() or 1)
    return 1.0 if load is not None and float(load) > cores else None


def _contended(data: dict[str, Any]) -> bool:
    share = _others_share_of(data)
    return share is not None and share > CONTENDED_SHARE


def _timed_now(key: dict[str, str], runs: int) -> dict[str, Any]:
    figures, share = others_share(lambda: measure(runs))
    now, load = time.time(), os.getloadavg()[0]
    where = "" if share is None else f", other processes {share:.0%} of the cores"
    return {
        "key": key,
        "figures": figures,
        "others_share": share,
        "load_average": round(load, 2),
        "timed_at": now,
        "when": f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(now))}{where}, load "
        f"average {load:.2f}",
    }


def _calibrate(refresh: bool, runs: int) -> DeviceFigures:
    key = machine_key()
    return _figures_of(_calibration_data(key, refresh, runs), key)


@contextlib.contextmanager
def pinned_calibration(path: str | Path) -> Iterator[None]:
    """Within the ``with``, this process and its children use the calibration in ``path`` (kept
    if it is this machine's, else written from the cache), unless :data:`CALIBRATION_ENV` is set."""
    if os.environ.get(CALIBRATION_ENV):
        yield
        return
    path = Path(path)
    key = machine_key()
    try:
        kept = json.loads(path.read_text()).get("key") == key
    except (OSError, json.JSONDecodeError, AttributeError):
        kept = False
    if not kept:
        with _CALIBRATING:
            data = _calibration_data(key, False, 5)
        files.write_text(path, json.dumps({**data, "pinned": True}, indent=1))
    os.environ[CALIBRATION_ENV] = str(path)
    try:
        yield
    finally:
        os.environ.pop(CALIBRATION_ENV, None)


def _calibration_data(key: dict[str, str], refresh: bool, runs: int) -> dict[str, Any]:
    """The calibration file's content for this machine: the given one, the cached one, or
    timed now (written to the cache)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "calibration" / f"{digest}.json"
    given = os.environ.get(CALIBRATION_ENV)
    data = None
    if given:  # figures fixed by the user (or the tests): used as they are, never re-timed
        data = json.loads(Path(given).read_text())
        data["key"] = key
        where = (  # a run's own copy (pinned_calibration), or a file the user named
            f"kept for this run in {given}"
            if data.get("pinned")
            else f"read from ${CALIBRATION_ENV}={given}"
        )
        data["when"] = f"{data.get('when', 'unknown date')}, {where}"
    elif path.exists() and not refresh:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            data = None
    if not given:
        cached = data if data is not None and data.get("key") == key else None
        if cached is None:  # none, another machine's, or refresh asked
            data = _timed_now(key, runs)
            files.write_text(path, json.dumps(data, indent=1))
        elif _contended(cached) and time.time() - cached.get("timed_at", 0) >= RETIME_AFTER_S:
            new = _timed_now(key, runs)
            share = new["others_share"]
            quieter = share is not None and share < (_others_share_of(cached) or 0.0)
            # no quieter: keep the figures, and wait as long again before the next try
            data = new if quieter else {**cached, "timed_at": new["timed_at"]}
            files.write_text(path, json.dumps(data, indent=1))
    assert data is not None
    return data


def _figures_of(data: dict[str, Any], key: dict[str, str]) -> DeviceFigures:
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
        calibration=Calibration(
            data.get("others_share"), data.get("load_average"), _contended(data)
        ),
        source=(
            f"calibrated on this machine {data['when']} (jax {key['jax']}, {key['cpu_count']} "
            f"cores{'; contended: its rates are low' if _contended(data) else ''}): "
            f"{', '.join(f'{k}={v:.4g}' for k, v in sorted(f.items()))}"
        ),
        measured=True,
    )


def device_figures(target: T.Target) -> DeviceFigures | None:
    """``target``'s datasheet figures (deviceless GPU/TPU) or the local calibration; None when
    neither is available."""
    import jax

    if not target.deviceless and target.platform == jax.devices()[0].platform:
        return calibrate()
    return datasheet_figures(target)


def figures_for(target: T.Target) -> DeviceFigures:
    """The device figures to time steps on ``target`` with (datasheet or calibration), or an error.

    Raises:
      ValueError: the target has no figures and is not the local device.
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
