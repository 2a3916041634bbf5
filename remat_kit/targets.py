"""Compile targets (local, CPU, GPU models and TPU slices compiled deviceless) and the meshes and
shardings a step is laid out with over their devices.

A :class:`Target` carries a device model's figures: memory (bytes), dense bf16 peak (FLOP/s),
memory and host-link bandwidth (bytes/s). A GPU target's :class:`GpuSpec` becomes XLA's
``GpuTargetConfig``, so a step compiles with no GPU present (:func:`abstract_sharding`); TPU
slices (:func:`tpu_target`) compile through ``libtpu`` on a CPU host. Mesh axes ``dp``, ``fsdp``,
``tp``: :data:`LOGICAL_RULES`, :data:`ACTIVATION_RULES`. Setup: docs/targets.md, docs/tpu.md,
docs/multi-device.md.

Sources: NVIDIA datasheets and whitepapers, Cloud TPU system architecture pages (per target in
``Target.source``); per-SM limits: CUDA C++ Programming Guide ("Technical Specifications per
Compute Capability"), XLA ``xla/backends/gpu/target_config/specs/*.txtpb``; slice topologies:
MaxText ``src/MaxText/accelerator_to_spec_map.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from remat_kit.validation import (
    MissingExtraError,
    check_batch_split,
    closest,
    unknown_value_error,
)

TPU_INSTALL_HINT = "pip install 'remat-kit[tpu]'"


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One TPU chip (= one JAX device). Bytes, FLOP/s, bytes/s; ``None``: no cited figure."""

    generation: str  # "v5p": the Cloud name's prefix
    device_kind: str  # what JAX reports: "TPU v5"
    topology_prefix: str  # "v5": the generation in topology names ("v5:2x2x1")
    tensorcores: int  # per chip; 2 (megacore) on v4 and v5p
    #: Usable HBM per chip: libtpu's RESOURCE_EXHAUSTED figure ("exceeds available HBM").
    memory_bytes: int
    peak_flops_bf16: float
    hbm_bytes_per_s: float
    #: ICI per direction per chip (Cloud's bidirectional figure / 2; Gbit/s: / 8 / 2).
    interconnect_bytes_per_s: float | None
    host_link_bytes_per_s: float | None
    description: str
    source: str
    sizes: tuple[tuple[int, str], ...]  # (the Cloud name's number, topology) per slice


def _sizes(text: str) -> tuple[tuple[int, str], ...]:
    return tuple((int(n), topo) for n, topo in (p.split(":") for p in text.split()))


# MaxText accelerator_to_spec_map.py: v4 / v5p are named by TensorCores (2 per chip).
_V4_SIZES = _sizes(
    "8:2x2x1 16:2x2x2 32:2x2x4 64:2x4x4 128:4x4x4 256:4x4x8 384:4x4x12 512:4x8x8 1024:8x8x8 "
    "1536:8x8x12 2048:8x8x16 4096:8x16x16"
)
_V5P_SIZES = _sizes(
    "8:2x2x1 16:2x2x2 32:2x2x4 64:2x4x4 128:4x4x4 256:4x4x8 384:4x4x12 512:4x8x8 640:4x4x20 "
    "768:4x8x12 896:4x4x28 1024:8x8x8 1152:4x12x12 1280:4x8x20 1408:4x4x44 1536:8x8x12 "
    "1664:4x4x52 1792:4x8x28 1920:4x12x20 2048:8x8x16 2176:4x4x68 2304:8x12x12 2432:4x4x76 "
    "2560:8x8x20 2688:4x12x28 2816:4x8x44 2944:4x4x92 3072:8x12x16 3200:4x20x20 3328:4x8x52 "
    "3456:12x12x12 3584:8x8x28 3712:4x4x116 3840:8x12x20 3968:4x4x124 4096:8x16x16 "
    "4224:4x12x44 4352:4x8x68 4480:4x20x28 4608:12x12x16 4736:4x4x148 4864:4x8x76 "
    "4992:4x12x52 5120:8x16x20 5248:4x4x164 5376:8x12x28 5504:4x4x172 5632:8x8x44 "
    "5760:12x12x20 5888:4x8x92 6016:4x4x188 6144:12x16x16 6272:4x28x28 6400:8x20x20 "
    "6528:4x12x68 6656:8x8x52 6784:4x4x212 6912:12x12x24 7040:4x20x44 7168:8x16x28 "
    "7296:4x12x76 7424:4x8x116 7552:4x4x236 7680:12x16x20 7808:4x4x244 7936:4x8x124 "
    "8064:12x12x28 8192:16x16x16 8320:4x20x52 8448:8x12x44 8704:8x8x68 8832:4x12x92 "
    "8960:8x20x28 9216:12x16x24 9472:4x8x148 9600:12x20x20 9728:8x8x76 9856:4x28x44 "
    "9984:8x12x52 10240:16x16x20 10368:12x12x36 10496:4x8x164 10752:12x16x28 10880:4x20x68 "
    "11008:4x8x172 11136:4x12x116 11264:8x16x44 11520:12x20x24 11648:4x28x52 11776:8x8x92 "
    "11904:4x12x124 12032:4x8x188 12160:4x20x76 12288:16x16x24 13824:12x24x24 17920:16x20x28"
)
# v5e / v6e are named by chips (1 TensorCore per chip).
_2D_SIZES = _sizes("1:1x1 4:2x2 8:2x4 16:4x4 32:4x8 64:8x8 128:8x16 256:16x16")

_DOCS = "Cloud TPU system architecture, cloud.google.com/tpu/docs/{}"
_HBM_NOTE = (
    "usable HBM: the TPU compiler's own figure in its out-of-memory message (libtpu 0.0.42.1)"
)

#: The chips, by Cloud generation name.
CHIPS: dict[str, TpuChip] = {
    c.generation: c
    for c in (
        TpuChip(
            generation="v4",
            device_kind="TPU v4",
            topology_prefix="v4",
            tensorcores=2,
            memory_bytes=int(30.75 * 2**30),
            peak_flops_bf16=275e12,
            hbm_bytes_per_s=1200e9,
            interconnect_bytes_per_s=None,
            host_link_bytes_per_s=None,
            description="Google TPU v4, 32 GiB HBM2, 2 TensorCores (megacore), 3D torus",
            source=_DOCS.format("v4")
            + " (275 TFLOP/s bf16 per chip, 32 GiB HBM2 at 1200 GB/s); ICI and host link: no "
            "per-direction figure in the docs (None); " + _HBM_NOTE,
            sizes=_V4_SIZES,
        ),
        TpuChip(
            generation="v5e",
            device_kind="TPU v5 lite",
            topology_prefix="v5e",
            tensorcores=1,
            memory_bytes=int(15.75 * 2**30),
            peak_flops_bf16=197e12,
            hbm_bytes_per_s=819e9,
            interconnect_bytes_per_s=200e9,
            host_link_bytes_per_s=None,
            description="Google TPU v5e (v5litepod), 16 GB HBM2, 1 TensorCore, 2D torus",
            source=_DOCS.format("v5e")
            + " (197 TFLOP/s bf16 per chip, 16 GB HBM2 at 819 GB/s, bidirectional ICI 400 GB/s "
            "per chip); host link: not in the docs (None); " + _HBM_NOTE,
            sizes=_2D_SIZES,
        ),
        TpuChip(
            generation="v5p",
            device_kind="TPU v5",
            topology_prefix="v5",
            tensorcores=2,
            memory_bytes=int(95.74 * 2**30),
            peak_flops_bf16=459e12,
            hbm_bytes_per_s=2765e9,
            interconnect_bytes_per_s=300e9,
            host_link_bytes_per_s=None,
            description="Google TPU v5p, 95 GB HBM2e, 2 TensorCores (megacore), 3D torus",
            source=_DOCS.format("v5p")
            + " (459 TFLOP/s bf16 per chip, 95 GB HBM2e at 2765 GB/s, interchip interconnect "
            "4800 Gbit/s); host link: not in the docs (None); " + _HBM_NOTE,
            sizes=_V5P_SIZES,
        ),
        TpuChip(
            generation="v6e",
            device_kind="TPU v6 lite",
            topology_prefix="v6e",
            tensorcores=1,
            memory_bytes=int(31.25 * 2**30),
            peak_flops_bf16=918e12,
            hbm_bytes_per_s=1600e9,
            interconnect_bytes_per_s=400e9,
            host_link_bytes_per_s=None,
            description="Google TPU v6e (Trillium), 32 GB HBM, 1 TensorCore, 2D torus",
            source=_DOCS.format("v6e")
            + " (918 TFLOP/s bf16 per chip, 32 GB HBM at 1600 GB/s, bidirectional ICI 800 GB/s "
            "per chip); host link: not in the docs (None); " + _HBM_NOTE,
            sizes=_2D_SIZES,
        ),
    )
}

#: Other spellings of a generation in slice names (Cloud's accelerator type for v5e).
ALIASES = {"v5litepod": "v5e", "v6": "v6e"}

_NAME = re.compile(r"^(?:(\d+)x)?(v\d+[a-z]*)-(\d+)$")


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A TPU slice (``num_slices`` joined) as ``get_topology_desc`` takes it; ``chips`` devices
    per slice, ``topology`` like ``"v5:2x2x1"``."""

    generation: str
    size: int  # the number in the Cloud name: TensorCores (v4, v5p) or chips (v5e, v6e)
    topology: str
    chips: int
    chip_config: str  # "megacore" (2 TensorCores as one device) or "default"
    chips_per_host_bounds: tuple[int, int, int]
    wrap: tuple[bool, bool, bool]
    num_slices: int = 1

    @property
    def num_devices(self) -> int:
        return self.chips * self.num_slices

    @property
    def name(self) -> str:
        base = f"{self.generation}-{self.size}"
        return base if self.num_slices == 1 else f"{self.num_slices}x{base}"


def _slice(chip: TpuChip, size: int, topology: str, num_slices: int) -> TpuSlice:
    dims = [int(d) for d in topology.split("x")]
    chips = 1
    for d in dims:
        chips *= d
    dims3 = (dims + [1, 1])[:3]
    if chip.tensorcores == 2:  # 3D torus: wrap-around once a dimension spans a full cube (4)
        bounds, wrap = (2, 2, 1), tuple(d >= 4 for d in dims3) if chips >= 64 else (False,) * 3
    else:  # 2D torus: wrap-around along a dimension of 16 chips
        bounds = (1, 1, 1) if chips == 1 else (2, 2, 1)
        wrap = (dims3[0] == 16, dims3[1] == 16, False)
    return TpuSlice(
        generation=chip.generation,
        size=size,
        topology=f"{chip.topology_prefix}:{topology}",
        chips=chips,
        chip_config="megacore" if chip.tensorcores == 2 else "default",
        chips_per_host_bounds=bounds,  # type: ignore[arg-type]
        wrap=wrap,  # type: ignore[arg-type]
        num_slices=num_slices,
    )


def slice_names(generation: str | None = None) -> list[str]:
    """Every single-slice name (``v4-8`` ... ``v6e-256``), of one generation if given."""
    return [
        f"{g}-{size}"
        for g, chip in CHIPS.items()
        if generation in (None, g)
        for size, _ in chip.sizes
    ]


def _sizes_text(generation: str) -> str:
    sizes = [s for s, _ in CHIPS[generation].sizes]
    if len(sizes) <= 12:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:6]))}, ... {sizes[-1]}; all in `remat-kit targets --json`"


def families() -> str:
    """The slice names in brief: ``v4-N (N: 8, 16, ..., 4096), ...``."""
    out = [f"{g}-N (N: {_sizes_text(g)})" for g in CHIPS]
    return "; ".join(out) + "; 'Kx' before a name for K slices (2xv5p-8)"


def parse_slice(name: str) -> TpuSlice | None:
    """The slice ``name`` (lower case, ``-``), ``None`` when not a TPU name (``h100-sxm``).

    Raises:
      ValueError: a size the generation does not come in (listing the valid ones), or a slice
        count of 0.
    """
    m = _NAME.match(name)
    if m is None:
        return None
    count, gen, size = m.group(1), m.group(2), int(m.group(3))
    gen = ALIASES.get(gen, gen)
    chip = CHIPS.get(gen)
    if chip is None:
        return None
    topology = dict(chip.sizes).get(size)
    if topology is None:
        raise ValueError(
            f"unknown TPU slice {name!r}: valid ones are {gen}-N, N: {_sizes_text(gen)}"
        )
    num_slices = int(count) if count else 1
    if num_slices < 1:
        raise ValueError(f"TPU slice {name!r}: the slice count must be >= 1")
    return _slice(chip, size, topology, num_slices)


# -- libtpu on a machine without a TPU --------------------------------------------------------


def has_tpu_chips() -> bool:
    """True when this machine shows TPU chips (JAX's own test, ``/dev/accel*`` or vfio)."""
    try:
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:  # a JAX without that helper: look for the device files
        return any(os.path.exists(f"/dev/accel{i}") for i in range(8))


def ensure_tpu_env() -> None:
    """On a machine without TPU chips, set where unset (on import): ``TPU_SKIP_MDS_QUERY=1`` (as
    axlearn's ``aot_compilation.py``), ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``,
    ``TPU_LOG_DIR=disabled`` (as marin-community/marin#2078) and, with libtpu and no
    accelerator, ``JAX_PLATFORMS=cpu``. Why each: docs/tpu.md."""
    if has_tpu_chips():
        return
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_LOG_DIR", "disabled")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    gpu_files = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
    if (
        "JAX_PLATFORMS" not in os.environ
        and libtpu_installed()
        and not any(os.path.exists(f) for f in gpu_files)
    ):
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax
        from jax._src import xla_bridge

        if jax.config.jax_platforms is None and not xla_bridge.backends_are_initialized():
            jax.config.update("jax_platforms", "cpu")


def libtpu_installed() -> bool:
    """True when JAX can find libtpu (the ``libtpu`` package or ``TPU_LIBRARY_PATH``)."""
    try:
        from jax._src import cloud_tpu_init

        return cloud_tpu_init.get_tpu_library_path() is not None
    except Exception:
        import importlib.util

        return importlib.util.find_spec("libtpu") is not None


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Hold back fd 2 inside the block (libtpu's start-up noise off a TPU VM); replay it if the
    block raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode("utf-8", "replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class LibtpuMissingError(MissingExtraError):
    """A TPU target was asked for and libtpu is not installed (message: the extra to install)."""


@functools.cache
def topology(tpu: TpuSlice) -> Any:
    """The deviceless ``TopologyDescription`` of ``tpu`` (cached; compile-only ``.devices``).

    Raises:
      LibtpuMissingError: libtpu is not installed.
    """
    if not libtpu_installed():
        raise LibtpuMissingError(
            f"TPU slice {tpu.name!r} needs libtpu (XLA's TPU compiler), which is not installed: "
            f"{TPU_INSTALL_HINT}"
        )
    from jax.experimental import topologies

    with _quiet_stderr():
        return topologies.get_topology_desc(
            topology_name=tpu.topology,
            platform="tpu",
            chip_config_name=tpu.chip_config,
            chips_per_host_bounds=tpu.chips_per_host_bounds,
            num_slices=tpu.num_slices,
            wrap=tpu.wrap,
        )


ensure_tpu_env()

#: Platforms a target compiles for (``local``: JAX's default backend).
Platform = Literal["cpu", "cuda", "rocm", "tpu"]

LOCAL = "local"

#: PJRT plugin modules that provide the ``cuda`` platform, newest first.
CUDA_PLUGIN_MODULES: tuple[str, ...] = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")

#: As ``jax._src.hardware_utils.has_visible_nvidia_gpu``.
_NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")

_SKIP_CHECK_VAR = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"

_INSTALL_HINT = "pip install 'remat-kit[cuda12]'"


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One NVIDIA GPU model as XLA's ``gpu_device_info`` (:func:`gpu_target_config`); memory
    and bandwidth come from the :class:`Target`. Bytes; clock in GHz."""

    core_count: int  # SMs
    cc_major: int  # compute capability: 9 for sm_90
    cc_minor: int
    l2_cache_bytes: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    threads_per_core_limit: int
    fpus_per_core: int  # FP32 lanes per SM
    clock_rate_ghz: float  # boost
    device_description: str  # JAX's device_kind on the real GPU
    cc_feature_extension: str | None = None  # ACCELERATED_FEATURES: sm_90a, as on real Hopper
    shared_memory_per_block: int = 48 * 1024
    threads_per_block_limit: int = 1024
    threads_per_warp: int = 32
    registers_per_core_limit: int = 64 * 1024
    registers_per_block_limit: int = 64 * 1024
    block_dim_limit: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    dnn_version: tuple[int, int, int] = (9, 8, 0)  # cuDNN assumed
    runtime_version: tuple[int, int, int] = (12, 8, 0)  # CUDA runtime assumed


@dataclasses.dataclass(frozen=True)
class Target:
    """A device model to compile for and judge memory against. Per device; ``None``: unknown."""

    name: str
    platform: Platform
    description: str
    #: Bytes as the CUDA driver reports them; ``local``: JAX's ``bytes_limit``.
    memory_bytes: int | None
    #: Dense bf16 peak, FLOP/s (no 2:4 sparsity).
    peak_flops_bf16: float | None
    hbm_bytes_per_s: float | None
    #: Host<->device, bytes/s per direction (:func:`host_link_source`).
    host_link_bytes_per_s: float | None
    #: Whether pinned-host offload is real (on CPU it compiles but changes nothing).
    supports_host_offload: bool
    source: str
    gpu: GpuSpec | None = None
    #: f32 matmul peak, FLOP/s, at JAX's default precision (TF32 on Ampere and newer).
    peak_flops_f32: float | None = None
    #: NVLink / TPU ICI, bytes/s per direction per device.
    interconnect_bytes_per_s: float | None = None
    #: Per-kernel launch cost, seconds.
    launch_s: float | None = None
    #: Measured shares of the datasheet peaks (None: the peak as is): large matmuls, streaming
    #: kernels, cuDNN fused attention (None: at ``matmul_efficiency``). Sources: docs/time-model.md.
    matmul_efficiency: float | None = None
    memory_efficiency: float | None = None
    attention_efficiency: float | None = None
    #: Devices per interconnect domain (a GPU node); beyond it collectives also use
    #: ``network_bytes_per_s`` (InfiniBand, per device per direction). None: one domain.
    node_size: int | None = None
    network_bytes_per_s: float | None = None
    tpu: TpuSlice | None = None

    @property
    def deviceless(self) -> bool:
        """True for a GPU model or TPU slice (compiled with no such device)."""
        return self.gpu is not None or self.tpu is not None

    @property
    def num_devices(self) -> int | None:
        """A TPU slice's devices; ``None`` for targets of any size."""
        return None if self.tpu is None else self.tpu.num_devices

    def usable_bytes(self, fraction: float = 1.0) -> int:
        """``fraction`` of device memory, in bytes (0.75: JAX's default
        ``XLA_PYTHON_CLIENT_MEM_FRACTION`` on a GPU).

        Raises:
            ValueError: the target's memory is unknown (``memory_bytes is None``), or ``fraction``
                is not in (0, 1].
        """
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if self.memory_bytes is None:
            raise ValueError(
                f"target {self.name!r} has unknown device memory (memory_bytes is None); "
                "pick a GPU target such as 'h100-sxm'"
            )
        return int(self.memory_bytes * fraction)

    def headroom_bytes(self, peak_bytes: int, fraction: float = 1.0) -> int:
        """Bytes left after a step that peaks at ``peak_bytes``; negative when it does not fit.

        Raises:
            ValueError: as :meth:`usable_bytes`.
        """
        return self.usable_bytes(fraction) - int(peak_bytes)

    def fits(self, peak_bytes: int, fraction: float = 1.0) -> bool:
        """Whether a step peaking at ``peak_bytes`` (per device) fits in ``fraction`` of memory.

        Raises:
            ValueError: as :meth:`usable_bytes`.
        """
        return self.headroom_bytes(peak_bytes, fraction) >= 0


# -- The built-in targets ---------------------------------------------------------------------

_HOPPER = dict(
    core_count=132,
    cc_major=9,
    cc_minor=0,
    cc_feature_extension="ACCELERATED_FEATURES",
    l2_cache_bytes=50 * 2**20,
    shared_memory_per_core=228 * 1024,
    shared_memory_per_block_optin=227 * 1024,
    threads_per_core_limit=2048,
    fpus_per_core=128,
    clock_rate_ghz=1.98,
)
_A100 = dict(
    core_count=108,
    cc_major=8,
    cc_minor=0,
    l2_cache_bytes=40 * 2**20,
    shared_memory_per_core=164 * 1024,
    shared_memory_per_block_optin=163 * 1024,
    threads_per_core_limit=2048,
    fpus_per_core=64,
    clock_rate_ghz=1.41,
)
_H100_SOURCE = (
    "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100) and NVIDIA H100 "
    "Tensor Core GPU Architecture whitepaper (SXM5: 132 SMs, 50 MB L2, 3.35 TB/s HBM3, "
    "989.4 TFLOP/s dense BF16, PCIe Gen5 x16); memory size: XLA specs/h100_sxm.txtpb"
)
_H200_SOURCE = (
    "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200: 141 GB HBM3e, "
    "4.8 TB/s, 1,979 TFLOP/s BF16 with sparsity, PCIe Gen5 x16); SM figures as H100 SXM "
    "(Hopper whitepaper); memory size: XLA specs/h200.txtpb"
)
_A100_SOURCE = (
    "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100: 312 TFLOP/s BF16 "
    "dense, {bw} GB/s, PCIe Gen4 x16) and NVIDIA A100 Tensor Core GPU Architecture whitepaper "
    "(108 SMs, 40 MB L2); memory size: XLA specs/{spec}.txtpb"
)
_L4_SOURCE = (
    "NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4: 24 GB GDDR6, "
    "300 GB/s, 242 TFLOP/s BF16 with sparsity, PCIe Gen4 x16) and NVIDIA Ada GPU Architecture "
    "whitepaper (58 SMs, 48 MB L2, 2.04 GHz boost); memory size: nvidia-smi total 23034 MiB"
)

# Measured efficiencies and links, cited in the _*_SOURCE strings; docs/time-model.md.
_MAMF_SOURCE = (
    "matmul efficiency: Maximum Achievable Matmul FLOPS, BF16, best shape (Bekman, ML "
    "Engineering Open Book, compute/accelerator/README.md): A100 SXM 271.2 of 312 TFLOP/s, "
    "H100 SXM 794.5 of 989 ('H200 is the same')"
)
_HOPPER_ATTENTION = 529.0 / 989.0
_ATTENTION_SOURCE = (
    "fused attention: cuDNN flash attention 529 TFLOP/s forward (causal) and 518 backward of 989, "
    "BF16, head dim 128, seq 8k, H100 SXM5 (Shah et al., FlashAttention-3, arXiv:2407.08608, "
    "Figs. 5-6)"
)
_HBM_EFFICIENCY = 0.88
_HBM_SOURCE = (
    "memory efficiency 88%: 1.80 of 2.04 TB/s measured on an A100 80GB SXM, ~90% the best any "
    "kernel reached in NVIDIA's GTC talk (NVIDIA Developer Forums, 'Trouble to Reach Peak "
    "Bandwidth of A100')"
)
_NVLINK_SOURCE = (
    "NVLink as measured ring bus bandwidth: A100 node all_reduce 235 GB/s busbw (of 300 per "
    "direction), H200 node 396.4 GB/s per direction (of 450) (Bekman, ML Engineering Open "
    "Book, network/README.md); between nodes 8 x {nic} InfiniBand per node (DGX {dgx} "
    "system specifications), a ring over nodes at min(NVLink, 8 x NIC)"
)

_CPU = Target(
    name="cpu",
    platform="cpu",
    description="the local CPU backend (jax.devices('cpu'))",
    memory_bytes=None,
    peak_flops_bf16=None,
    hbm_bytes_per_s=None,
    host_link_bytes_per_s=None,
    supports_host_offload=False,
    source="local machine",
)

_GPU_TARGETS: tuple[Target, ...] = (
    Target(
        name="h100-sxm",
        platform="cuda",
        description="NVIDIA H100 SXM5 80 GB HBM3 (Hopper, sm_90a)",
        memory_bytes=84_942_979_072,
        peak_flops_bf16=989.4e12,
        hbm_bytes_per_s=3.35e12,
        host_link_bytes_per_s=64e9,
        supports_host_offload=True,
        source=f"{_H100_SOURCE}; {_MAMF_SOURCE}; {_ATTENTION_SOURCE}; {_HBM_SOURCE}; "
        + _NVLINK_SOURCE.format(nic="400 Gb/s NDR", dgx="H100"),
        matmul_efficiency=794.5 / 989.0,
        memory_efficiency=_HBM_EFFICIENCY,
        attention_efficiency=_HOPPER_ATTENTION,
        interconnect_bytes_per_s=396.4e9,
        node_size=8,
        network_bytes_per_s=50e9,
        gpu=GpuSpec(**_HOPPER, device_description="NVIDIA H100 80GB HBM3"),
    ),
    Target(
        name="h200",
        platform="cuda",
        description="NVIDIA H200 SXM 141 GB HBM3e (Hopper, sm_90a)",
        memory_bytes=151_397_597_184,
        peak_flops_bf16=989.4e12,
        hbm_bytes_per_s=4.8e12,
        host_link_bytes_per_s=64e9,
        supports_host_offload=True,
        source=f"{_H200_SOURCE}; {_MAMF_SOURCE}; {_ATTENTION_SOURCE}; {_HBM_SOURCE}; "
        + _NVLINK_SOURCE.format(nic="400 Gb/s NDR", dgx="H200"),
        matmul_efficiency=794.5 / 989.0,
        memory_efficiency=_HBM_EFFICIENCY,
        attention_efficiency=_HOPPER_ATTENTION,
        interconnect_bytes_per_s=396.4e9,
        node_size=8,
        network_bytes_per_s=50e9,
        gpu=GpuSpec(**_HOPPER, device_description="NVIDIA H200"),
    ),
    Target(
        name="a100-80gb",
        platform="cuda",
        description="NVIDIA A100 SXM4 80 GB HBM2e (Ampere, sm_80)",
        memory_bytes=85_100_068_864,
        peak_flops_bf16=312e12,
        hbm_bytes_per_s=2.039e12,
        host_link_bytes_per_s=32e9,
        supports_host_offload=True,
        source=f"{_A100_SOURCE.format(bw='2,039', spec='a100_sxm_80')}; {_MAMF_SOURCE}; "
        f"{_HBM_SOURCE}; " + _NVLINK_SOURCE.format(nic="200 Gb/s HDR", dgx="A100"),
        matmul_efficiency=271.2 / 312.0,
        memory_efficiency=_HBM_EFFICIENCY,
        interconnect_bytes_per_s=235e9,
        node_size=8,
        network_bytes_per_s=25e9,
        gpu=GpuSpec(**_A100, device_description="NVIDIA A100-SXM4-80GB"),
    ),
    Target(
        name="a100-40gb",
        platform="cuda",
        description="NVIDIA A100 SXM4 40 GB HBM2 (Ampere, sm_80)",
        memory_bytes=42_331_013_120,
        peak_flops_bf16=312e12,
        hbm_bytes_per_s=1.555e12,
        host_link_bytes_per_s=32e9,
        supports_host_offload=True,
        source=f"{_A100_SOURCE.format(bw='1,555', spec='a100_sxm_40')}; {_MAMF_SOURCE}; "
        f"{_HBM_SOURCE}; " + _NVLINK_SOURCE.format(nic="200 Gb/s HDR", dgx="A100"),
        matmul_efficiency=271.2 / 312.0,
        memory_efficiency=_HBM_EFFICIENCY,
        interconnect_bytes_per_s=235e9,
        node_size=8,
        network_bytes_per_s=25e9,
        gpu=GpuSpec(**_A100, device_description="NVIDIA A100-SXM4-40GB"),
    ),
    Target(
        name="l4",
        platform="cuda",
        description="NVIDIA L4 24 GB GDDR6 (Ada Lovelace, sm_89)",
        memory_bytes=23034 * 2**20,
        peak_flops_bf16=121e12,
        hbm_bytes_per_s=300e9,
        host_link_bytes_per_s=32e9,
        supports_host_offload=True,
        source=f"{_L4_SOURCE}; {_MAMF_SOURCE} (no L4 figure: H100's share assumed); "
        f"{_HBM_SOURCE}; PCIe card: no NVLink",
        matmul_efficiency=794.5 / 989.0,
        memory_efficiency=_HBM_EFFICIENCY,
        gpu=GpuSpec(
            core_count=58,
            cc_major=8,
            cc_minor=9,
            l2_cache_bytes=48 * 2**20,
            shared_memory_per_core=100 * 1024,
            shared_memory_per_block_optin=99 * 1024,
            threads_per_core_limit=1536,
            fpus_per_core=128,
            clock_rate_ghz=2.04,
            device_description="NVIDIA L4",
        ),
    ),
)

#: Fixed targets by name; ``local`` is resolved at use time by :func:`get_target`.
TARGETS: dict[str, Target] = {t.name: t for t in (_CPU, *_GPU_TARGETS)}


def tpu_target(name: str | TpuSlice) -> Target:
    """The :class:`Target` of a TPU slice (``"v5p-8"``, ``"2xv6e-256"``), per chip.
    ``peak_flops_f32`` is the bf16 peak (JAX's default TPU f32 dot is one bf16 MXU pass).

    Raises:
      ValueError: not a TPU slice name, or a size the generation does not come in.
    """
    tpu = name if isinstance(name, TpuSlice) else parse_slice(str(name).strip().lower())
    if tpu is None:
        raise ValueError(f"{name!r} is not a TPU slice: valid ones are {families()}")
    chip = CHIPS[tpu.generation]
    many = f"{tpu.num_slices} slices of " if tpu.num_slices > 1 else ""
    return Target(
        name=tpu.name,
        platform="tpu",
        description=(
            f"{many}{tpu.chips} chip{'' if tpu.chips == 1 else 's'} ({tpu.topology}) of "
            f"{chip.description}"
        ),
        memory_bytes=chip.memory_bytes,
        peak_flops_bf16=chip.peak_flops_bf16,
        hbm_bytes_per_s=chip.hbm_bytes_per_s,
        host_link_bytes_per_s=chip.host_link_bytes_per_s,
        supports_host_offload=True,
        source=chip.source,
        peak_flops_f32=chip.peak_flops_bf16,
        interconnect_bytes_per_s=chip.interconnect_bytes_per_s,
        launch_s=None,
        tpu=tpu,
    )


def target_names() -> list[str]:
    """``local``, ``cpu``, the GPU models, every single TPU slice (``2xv5p-8`` valid, unlisted)."""
    return [LOCAL, *TARGETS, *slice_names()]


def get_target(name: str | Target) -> Target:
    """The :class:`Target` called ``name`` (case-insensitive, ``_`` as ``-``). ``local``: JAX's
    default backend now, memory from ``memory_stats()["bytes_limit"]``, a known GPU's figures.

    Raises:
        ValueError: ``name`` is not a target (listing the valid names and the closest).
    """
    if isinstance(name, Target):
        return name
    key = str(name).strip().lower().replace("_", "-")
    if key == LOCAL:
        return _local_target()
    if key in TARGETS:
        return TARGETS[key]
    if parse_slice(key) is not None:  # raises on a TPU generation's unknown size
        return tpu_target(key)
    names = [LOCAL, *TARGETS]
    close = closest(key, names)  # a prefix ("h100") beats a near spelling ("h200")
    hint = f" Did you mean {close!r}?" if close else ""
    slices = ", ".join(f"{g}-N" for g in CHIPS)
    raise ValueError(
        f"unknown target {name!r}; valid: {', '.join(names)}, TPU slices {slices} (e.g. "
        f"v5p-8, v6e-256; sizes in `remat-kit targets`).{hint}"
    )


def compile_identity(target: Target) -> str:
    """The compile caches' key for ``target``'s compiler: ``cpu`` for every CPU target, else
    its name."""
    if target.platform == "cpu" and target.gpu is None and target.tpu is None:
        return "cpu"
    return target.name


def _local_target() -> Target:
    device = jax.devices()[0]
    platform = device.platform
    if platform == "gpu":
        version = getattr(device.client, "platform_version", "").lower()
        platform = "rocm" if "rocm" in version else "cuda"
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        stats = {}
    limit = stats.get("bytes_limit")
    memory_bytes = int(limit) if limit else None
    description = f"the local {platform} backend: {device.device_kind}"
    for known in _GPU_TARGETS:
        if known.gpu is not None and known.gpu.device_description == device.device_kind:
            return dataclasses.replace(
                known, name=LOCAL, description=description, memory_bytes=memory_bytes, gpu=None
            )
    return Target(
        name=LOCAL,
        platform=platform,  # type: ignore[arg-type]
        description=description,
        memory_bytes=memory_bytes,
        peak_flops_bf16=None,
        hbm_bytes_per_s=None,
        host_link_bytes_per_s=None,
        supports_host_offload=platform != "cpu",
        source="jax.devices()[0].memory_stats()",
    )


# -- The deviceless environment ---------------------------------------------------------------


def has_visible_nvidia_gpu() -> bool:
    """True when this machine shows an NVIDIA GPU device file."""
    return any(os.path.exists(path) for path in _NVIDIA_DEVICE_FILES)


def ensure_deviceless_env() -> bool:
    """Without an NVIDIA GPU, set ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` where unset (on import)
    so the CUDA plugin loads for deviceless compiles; returns whether the check is skipped.
    Why and when it takes effect: docs/targets.md."""
    if not has_visible_nvidia_gpu():
        os.environ.setdefault(_SKIP_CHECK_VAR, "1")
    return bool(os.environ.get(_SKIP_CHECK_VAR))


ensure_deviceless_env()


def cuda_plugin_module() -> str | None:
    """The installed CUDA PJRT plugin module, or ``None``."""
    for module in CUDA_PLUGIN_MODULES:
        try:
            if importlib.util.find_spec(module) is not None:
                return module
        except (ImportError, ValueError):  # no ``jax_plugins`` namespace at all
            return None
    return None


# -- Compiling for a target -------------------------------------------------------------------


def gpu_target_config(target: str | Target) -> str:
    """The ``GpuTargetConfig`` text proto that describes ``target`` to XLA.

    Raises:
        ValueError: ``target`` is unknown or not a GPU model compiled deviceless.
    """
    t = get_target(target)
    g = t.gpu
    if g is None or t.memory_bytes is None or t.hbm_bytes_per_s is None:
        raise ValueError(f"target {t.name!r} is not a deviceless GPU target")
    extension = f" feature_extension: {g.cc_feature_extension}" if g.cc_feature_extension else ""
    dnn, rt = g.dnn_version, g.runtime_version
    return "\n".join(
        [
            "gpu_device_info {",
            f"  threads_per_block_limit: {g.threads_per_block_limit}",
            f"  threads_per_warp: {g.threads_per_warp}",
            f"  shared_memory_per_block: {g.shared_memory_per_block}",
            f"  shared_memory_per_core: {g.shared_memory_per_core}",
            f"  threads_per_core_limit: {g.threads_per_core_limit}",
            f"  core_count: {g.core_count}",
            f"  fpus_per_core: {g.fpus_per_core}",
            f"  block_dim_limit_x: {g.block_dim_limit[0]}",
            f"  block_dim_limit_y: {g.block_dim_limit[1]}",
            f"  block_dim_limit_z: {g.block_dim_limit[2]}",
            f"  memory_bandwidth: {int(t.hbm_bytes_per_s)}",
            f"  l2_cache_size: {g.l2_cache_bytes}",
            f"  clock_rate_ghz: {g.clock_rate_ghz}",
            f"  device_memory_size: {t.memory_bytes}",
            f"  shared_memory_per_block_optin: {g.shared_memory_per_block_optin}",
            f"  cuda_compute_capability {{ major: {g.cc_major} minor: {g.cc_minor}{extension} }}",
            f"  registers_per_core_limit: {g.registers_per_core_limit}",
            f"  registers_per_block_limit: {g.registers_per_block_limit}",
            "}",
            'platform_name: "CUDA"',
            f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}",
            f"runtime_version {{ major: {rt[0]} minor: {rt[1]} patch: {rt[2]} }}",
            f'device_description_str: "{g.device_description}"',
            "",
        ]
    )


def compile_devices(target: str | Target, num_devices: int = 1) -> list[jax.Device]:
    """``num_devices`` devices to compile for ``target`` on: ``jax.devices()`` for ``local`` /
    ``cpu``; else compile-only devices (cached) that only take abstract arguments
    (:func:`abstract_sharding`) and ``.lower(...).compile()``.

    Raises:
        ValueError: unknown target; ``num_devices`` < 1; more devices than the target has.
        remat_kit.validation.MissingExtraError: no libtpu (TPU) or CUDA plugin (GPU).
        RuntimeError: the CUDA plugin would not register.
    """
    t = get_target(target)
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if t.gpu is not None:
        return list(_cuda_topology(t, num_devices).devices)
    if t.tpu is not None:
        if num_devices > t.tpu.num_devices:
            raise ValueError(
                f"target {t.name!r} has {t.tpu.num_devices} devices (chips), {num_devices} asked; "
                f"pick a larger slice or fewer devices"
            )
        return list(topology(t.tpu).devices)[:num_devices]
    devices = jax.devices("cpu") if t.name == "cpu" else jax.devices()
    if len(devices) < num_devices:
        fix = (
            "; for N CPU devices set JAX_NUM_CPU_DEVICES=N in the environment (or call "
            "jax.config.update('jax_num_cpu_devices', N) before JAX's first use)"
            if devices[0].platform == "cpu"
            else ""
        )
        raise ValueError(
            f"target {t.name!r} has {len(devices)} device(s), {num_devices} asked{fix}"
        )
    return devices[:num_devices]


@functools.cache
def _cuda_topology(target: Target, num_devices: int) -> Any:
    """A deviceless ``TopologyDescription`` of ``num_devices`` GPUs of ``target`` (cached)."""
    from jax.experimental import topologies

    if cuda_plugin_module() is None:
        raise MissingExtraError(
            f"target {target.name!r} needs JAX's CUDA plugin, which is not installed: "
            f"{_INSTALL_HINT}"
        )
    config = gpu_target_config(target)

    def make() -> Any:
        return topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=f"1x1x{num_devices}"
        )

    try:
        return make()
    except NotImplementedError:
        # plugins discovered before JAX_SKIP_CUDA_CONSTRAINTS_CHECK was set
        _register_cuda_plugin(target)
        return make()


def _register_cuda_plugin(target: Target) -> None:
    module = cuda_plugin_module()
    os.environ[_SKIP_CHECK_VAR] = "1"
    try:
        importlib.import_module(module).initialize()  # type: ignore[arg-type]
    except Exception as err:
        raise RuntimeError(
            f"target {target.name!r}: JAX's CUDA plugin {module} would not register "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            f"reinstall it with {_INSTALL_HINT}"
        ) from err


def target_mesh(
    target: str | Target,
    num_devices: int = 1,
    axis_names: Sequence[str] = ("x",),
    mesh_shape: Sequence[int] | None = None,
) -> Mesh:
    """A ``Mesh`` over :func:`compile_devices` of ``target``.

    ``mesh_shape`` defaults to ``(num_devices,)`` for one axis.

    Raises:
        ValueError: ``mesh_shape`` missing for several axes, of the wrong length, or not
            multiplying to ``num_devices``; and as :func:`compile_devices`.
    """
    axis_names = tuple(axis_names)
    if mesh_shape is None:
        if len(axis_names) != 1:
            raise ValueError(f"give mesh_shape for the {len(axis_names)} axes {axis_names}")
        mesh_shape = (num_devices,)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if len(mesh_shape) != len(axis_names) or math.prod(mesh_shape) != num_devices:
        raise ValueError(
            f"mesh_shape {mesh_shape} must have one size per axis of {axis_names} and multiply "
            f"to num_devices={num_devices}"
        )
    devices = compile_devices(target, num_devices)
    return Mesh(np.asarray(devices, dtype=object).reshape(mesh_shape), axis_names)


def abstract_sharding(
    target: str | Target,
    num_devices: int = 1,
    spec: PartitionSpec = PartitionSpec(),  # noqa: B008 (immutable)
    axis_names: Sequence[str] = ("x",),
    mesh_shape: Sequence[int] | None = None,
) -> NamedSharding:
    """``NamedSharding(target_mesh(...), spec)`` for abstract arguments (``"h100-sxm", 8``: 8
    GPUs, deviceless)::

        >>> import jax.numpy as jnp
        >>> s = abstract_sharding("local", 1, PartitionSpec("x"))
        >>> x = jax.ShapeDtypeStruct((8, 16, 32), jnp.bfloat16, sharding=s)  # [batch, seq, d_model]
        >>> x.sharding.spec == PartitionSpec("x"), x.sharding.mesh.axis_names
        (True, ('x',))

    Raises:
        ValueError: as :func:`target_mesh`.
    """
    return NamedSharding(target_mesh(target, num_devices, axis_names, mesh_shape), spec)


def abstractify(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """``tree`` with each leaf having ``.shape`` and ``.dtype`` as a ``jax.ShapeDtypeStruct``
    with ``sharding``."""

    def leaf(x: Any) -> Any:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return x

    return jax.tree.map(leaf, tree)


def host_link_source(target: Target) -> str:
    """Where ``target.host_link_bytes_per_s`` comes from: PCIe line rate per direction (Gen5 x16:
    32 GT/s x 16 x 128b/130b = 63, written 64 GB/s; Gen4 x16: 32 GB/s; PCI-SIG, NVIDIA
    datasheets give both directions); real copies get less."""
    bw = target.host_link_bytes_per_s
    if bw is None:
        return f"target {target.name!r}: host link unknown"
    gen = {64e9: "PCIe Gen5 x16", 32e9: "PCIe Gen4 x16"}.get(bw)
    what = f"{gen}, " if gen else ""
    return (
        f"{bw / 1e9:.0f} GB/s per direction ({what}PCI-SIG line rate x16 lanes, 128b/130b; "
        f"{target.description} datasheet: see Target.source)"
    )


MESH_AXES: tuple[str, ...] = ("dp", "fsdp", "tp")

#: Logical parameter axis -> mesh axes.
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("embed", "fsdp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("vocab", "tp"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("positions", None),
)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the ``dp``, ``fsdp`` and ``tp`` mesh axes."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1

    @property
    def num_devices(self) -> int:
        return self.dp * self.fsdp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.dp, self.fsdp, self.tp)

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in MESH_AXES)

    @classmethod
    def of(cls, mesh: Mesh) -> MeshSpec:
        """The sizes of a mesh made by :func:`make_mesh`."""
        return cls(**{a: int(mesh.shape[a]) for a in MESH_AXES})


def parse_mesh(text: str | MeshSpec | None, num_devices: int | None = None) -> MeshSpec:
    """Parse ``"fsdp=8"`` or ``"dp=2,fsdp=4,tp=1"`` (unnamed axes: 1; ``None``/``""``: dp only).

    Raises:
      ValueError: an unknown axis, a size not a positive integer, or a product other than
        ``num_devices``.
    """
    if isinstance(text, MeshSpec):
        spec = text
    elif not text:
        spec = MeshSpec(dp=num_devices or 1)
    else:
        sizes: dict[str, int] = {}
        for part in str(text).split(","):
            m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(\S+)\s*", part)
            if not m:
                raise ValueError(
                    f"bad mesh entry {part!r} in {text!r}; write e.g. 'dp=2,fsdp=4,tp=1'"
                )
            axis, size = m.group(1), m.group(2)
            if axis not in MESH_AXES:
                raise unknown_value_error("mesh axis", axis, MESH_AXES)
            if not size.isdigit() or int(size) <= 0:
                raise ValueError(
                    f"mesh axis {axis} must have a positive integer size, got {size!r}"
                )
            sizes[axis] = int(size)
        spec = MeshSpec(**sizes)
    if num_devices is not None and spec.num_devices != num_devices:
        raise ValueError(
            f"mesh {spec} has {spec.num_devices} device(s) (product of its sizes) but "
            f"{num_devices} device(s) were asked for"
        )
    return spec


def make_mesh(spec: MeshSpec, devices: Sequence[Any]) -> Mesh:
    """A (dp, fsdp, tp) ``Mesh`` over ``devices``.

    Raises:
      ValueError: ``len(devices)`` differs from the mesh's device count.
    """
    if len(devices) != spec.num_devices:
        raise ValueError(f"mesh {spec} needs {spec.num_devices} devices, got {len(devices)}")
    return Mesh(np.asarray(devices).reshape(spec.shape), MESH_AXES)


def _mesh_axis_size(mesh: Mesh, axes: Any) -> int:
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def check_divisible(path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> None:
    """Check each sharded dimension divides by its mesh axes.

    Raises:
      ValueError: naming the array, the dimension, its size and the mesh axis size.
    """
    for dim, (size, axes) in enumerate(
        zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True)
    ):
        n = _mesh_axis_size(mesh, axes)
        if n > 1 and size % n:
            raise ValueError(
                f"{path}: dimension {dim} of size {size} is not divisible by mesh axes {axes} "
                f"of size {n}"
            )


def param_shardings(boxed_params: Any, mesh: Mesh) -> Any:
    """``NamedSharding`` per parameter from the logical axes the modules annotate.

    ``boxed_params``: flax ``LogicallyPartitioned`` boxes (``training.init_boxed_params``).

    Raises:
      ValueError: as :func:`check_divisible`.
    """
    logical = nn.get_partition_spec(boxed_params)
    specs = nn.logical_to_mesh(logical, LOGICAL_RULES)
    unboxed = nn.meta.unbox(boxed_params)
    flat, _ = jax.tree_util.tree_flatten_with_path(unboxed)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, leaf), spec in zip(flat, spec_leaves, strict=True):
        check_divisible(jax.tree_util.keystr(path), tuple(leaf.shape), spec, mesh)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def like_params_shardings(tree: Any, params: Any, shardings: Any, mesh: Mesh) -> Any:
    """Shardings for a tree holding copies of the parameters (optimizer moments): a leaf whose
    path ends with a parameter's and has its shape gets its sharding; the rest replicated."""
    by_path = {}
    for (path, leaf), sharding in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(shardings), strict=True
    ):
        by_path[jax.tree_util.keystr(path)] = (tuple(leaf.shape), sharding)
    replicated = NamedSharding(mesh, PartitionSpec())

    def pick(path, leaf):
        key = jax.tree_util.keystr(path)
        for suffix, (shape, sharding) in by_path.items():
            if key.endswith(suffix) and tuple(getattr(leaf, "shape", ())) == shape:
                return sharding
        return replicated

    return jax.tree_util.tree_map_with_path(pick, tree)


def local_mesh(mesh: str | MeshSpec | None = None) -> Mesh:
    """A (dp, fsdp, tp) ``Mesh`` over ``jax.devices()``; ``mesh`` as :func:`parse_mesh` takes it.

    Raises:
      ValueError: as :func:`parse_mesh`, or a product other than ``jax.device_count()``.
    """
    devices = jax.devices()
    spec = parse_mesh(mesh) if mesh else MeshSpec(dp=len(devices))
    if spec.num_devices != len(devices):
        more = (
            "; on a CPU, JAX_NUM_CPU_DEVICES=N (set before JAX starts) gives N devices"
            if devices[0].platform == "cpu"
            else ""
        )
        raise ValueError(
            f"mesh {spec} needs {spec.num_devices} devices (product of its sizes) but this run "
            f"has {len(devices)} (jax.device_count()){more}"
        )
    return make_mesh(spec, devices)


def put_global(host: Any, shardings: Any) -> Any:
    """Host (numpy) arrays as global ``jax.Array`` s with ``shardings``: each process passes the
    whole value and keeps its devices' shards (``jax.make_array_from_callback``)."""

    def put(x: Any, sharding: Any) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, host, shardings)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch arrays [batch, seq] split over (dp, fsdp) along the batch dimension."""
    return NamedSharding(mesh, PartitionSpec(("dp", "fsdp"), None))


def check_batch(batch_size: int, mesh: Mesh, micro_batches: int = 1) -> None:
    """Check each micro-batch splits evenly over the (dp, fsdp) devices of ``mesh``.

    Raises:
      ValueError: naming the batch size, the micro-batch count and dp*fsdp.
    """
    split = mesh.shape["dp"] * mesh.shape["fsdp"]
    check_batch_split(batch_size, split, micro_batches=micro_batches, mesh=str(MeshSpec.of(mesh)))


#: Logical activation axis -> mesh axes inside :func:`activation_sharding`.
ACTIVATION_RULES: tuple[tuple[str, Any], ...] = (("activation_batch", ("dp", "fsdp")),)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None):
    """At trace time, split the batch of activations the models constrain
    (``nn.with_logical_constraint``) over (dp, fsdp) of ``mesh``; ``None``: XLA's propagation
    (which may keep whole activations per device under fsdp, docs/results/compiler.md)."""
    if mesh is None:
        with nn.logical_axis_rules(()):
            yield
        return
    with (
        nn.logical_axis_rules(ACTIVATION_RULES),
        jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
    ):
        yield
