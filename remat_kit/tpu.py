"""TPU slices compiled on a machine without a TPU: names, chips, topologies and libtpu's setup.

XLA's TPU compiler ships in ``libtpu`` (``pip install 'remat-kit[tpu]'``, which brings jax's
``tpu`` extra). With it, ``jax.experimental.topologies.get_topology_desc(platform="tpu", ...)``
describes a whole slice on a CPU host, and a step lowered on a mesh over its devices compiles
with the slice's per-device memory, including real host offload (``pinned_host``). MaxText's
``train_compile.py`` and axlearn's ``aot_compilation.py`` compile this way.

Slices are named as Cloud TPU names them: ``v4-8``, ``v5p-128`` (the number counts TensorCores:
two per v4 / v5p chip), ``v5e-16`` (also ``v5litepod-16``), ``v6e-256`` (the number counts chips:
one TensorCore per chip). A name ``2xv5p-8`` is two v5p-8 slices joined over the data-center
network (multi-slice; ``num_slices`` of ``get_topology_desc``).

v4 and v5p chips have two TensorCores run as one JAX device ("megacore"): per-device figures
are per-chip figures, and a v5p-8 is 4 JAX devices.

Sources: the slice -> topology table is that of MaxText ``src/MaxText/accelerator_to_spec_map.py``
(AI-Hypercomputer/maxtext: topology name, chip config, chips per host, wrap-around), which
follows Cloud TPU's slice tables (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e). Chip figures in
:data:`CHIPS`, each with its source.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from remat_kit.validation import MissingExtraError

#: Install hint for libtpu (jax's ``tpu`` extra).
TPU_INSTALL_HINT = "pip install 'remat-kit[tpu]'"


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """Figures of one TPU chip (= one JAX device, megacore included). Units: bytes, FLOP/s,
    bytes/s. ``None``: no cited figure."""

    generation: str  # "v5p": the Cloud name's prefix
    device_kind: str  # what JAX reports: "TPU v5"
    topology_prefix: str  # "v5": the generation in topology names ("v5:2x2x1")
    tensorcores: int  # per chip; 2 (megacore) on v4 and v5p
    #: HBM the TPU compiler lets a program use, per chip: its own figure in the
    #: RESOURCE_EXHAUSTED message ("exceeds available HBM (95.74G)"), libtpu 0.0.42.1. A
    #: little under the marketing size (the runtime reserves some).
    memory_bytes: int
    peak_flops_bf16: float
    hbm_bytes_per_s: float
    #: ICI bytes/s per direction per chip (Cloud's bidirectional per-chip figure / 2, or its
    #: "interchip interconnect BW" in Gbit/s / 8 / 2).
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
    """One TPU slice (or several joined: ``num_slices``) as ``get_topology_desc`` takes it.

    ``chips`` JAX devices per slice (megacore: one per chip); ``topology`` like ``"v5:2x2x1"``.
    """

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
    """The slice named ``name`` (normalised: lower case, ``_`` as ``-``), ``None`` when the
    name is not of a TPU generation at all (``h100-sxm``).

    Raises:
      ValueError: a TPU generation with a size it does not come in (the message lists the
        valid sizes), or a slice count of 0.
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
    """Environment libtpu needs on a machine without TPU chips; set only where unset, before
    libtpu loads (this module's import; remat_kit.targets imports it).

    - ``TPU_SKIP_MDS_QUERY=1``: do not ask the GCE metadata server for the TPU's configuration
      (there is none; axlearn's ``aot_compilation.py`` sets it too; JAX sets it itself only when
      it initialises the TPU backend).
    - ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``: libtpu takes ``/tmp/libtpu_lockfile`` for the process
      that owns the TPU; with no TPU there is nothing to share, and without it a second process
      (another compile, a pytest worker) fails with "Internal error when accessing libtpu
      multi-process lockfile" (measured here).

    - ``JAX_PLATFORMS=cpu`` when libtpu is installed and the machine has no accelerator at all
      (no TPU chips, no ``/dev/nvidia*``, no ``/dev/kfd``): otherwise JAX's first backend use
      loads libtpu to look for a TPU, which costs seconds and prints libtpu's start-up lines on
      every run. The local backend is the CPU either way.

    On a TPU machine nothing is set: the runtime there needs the real values.
    """
    if has_tpu_chips():
        return
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
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

        # JAX read the variable when it was imported: tell its config too, while it can change.
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
    """File descriptor 2 into a temporary file inside the block; written back only when the
    block raises. libtpu, when it starts on a host that is not a TPU VM, logs lines about
    ``TPU_ACCELERATOR_TYPE`` and ``TPU_WORKER_HOSTNAMES`` it cannot read (INVALID_ARGUMENT):
    noise for a compile-only topology."""
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
    """The deviceless ``TopologyDescription`` of ``tpu`` (cached): ``.devices`` are its
    compile-only devices, ``num_slices`` slices of ``chips`` each.

    Raises:
      LibtpuMissingError: libtpu is not installed (one line naming the extra).
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
