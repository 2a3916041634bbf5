"""Host-memory buffers of a compiled step, read from XLA's buffer assignment dump: how the
compiled host bytes (a peak over the step) relate to the bytes the jaxpr offloads (a sum).

XLA places offloaded tensors in memory space 5 (``S(5)`` in their layout; ``color 5`` in the
buffer assignment). Offloaded buffers that are never live at once share one host allocation,
so the compiled host bytes can be well below the jaxpr's sum (an example:
docs/results/compiler.md).
"""

from __future__ import annotations

import dataclasses

from remat_kit.memory.hlo import (
    BufferSlot,
    DumpFiles,
    array_shapes,
    parse_allocation_sizes,
    shape_bytes,
)
from remat_kit.units import format_bytes

#: Host bytes and offloaded bytes differing by less than this share are not remarked on.
_TOLERANCE = 0.01


@dataclasses.dataclass(frozen=True)
class HostBuffers:
    """Host memory of one compile: ``allocated`` bytes of host allocations, holding ``count``
    buffers of ``buffer_bytes`` in all (more than ``allocated``: space reused)."""

    allocated: int
    count: int
    buffer_bytes: int
    #: Bytes of the same buffers' values, unpadded (their shapes' elements x dtype size): below
    #: ``buffer_bytes`` where the layout pads a dimension (a TPU tile, ``T(8,128)``). None:
    #: not read.
    value_bytes: int | None = None


def host_buffers(dump: DumpFiles) -> HostBuffers | None:
    """The host allocations of a compile's buffer assignment, from its slots as
    :attr:`~remat_kit.memory.hlo.DumpFiles.slots` parsed them (None: no dump or no host
    buffer)."""
    if not dump.buffer_assignment:
        return None
    host = _buffers(
        {name: s for name, s in dump.slots.items() if s.on_host}, dump.live_ranges.ranges
    )
    sizes = parse_allocation_sizes(dump.buffer_assignment)
    allocated = sum(sizes[a] for a in {s.allocation for s in host})
    if not host:
        return None
    values = sum(shape_bytes(t, d) for s in host for t, d in array_shapes(s.shape))
    return HostBuffers(allocated, len(host), sum(s.nbytes for s in host), values)


def _buffers(slots: dict[str, BufferSlot], ranges: dict[str, tuple[int, int]]) -> list[BufferSlot]:
    """One slot per buffer: the values that alias one buffer (a scan's stacked residual threads
    the loop's parameter, tuple element, in-place update and result through one place: five
    values, 128 KiB, on a v5e target) sit at one allocation, offset and size with live ranges
    that chain (each starts where the one before ends); values reusing the place later, each
    dead before the next is defined, are buffers of their own. A value with no live range is
    its own buffer."""
    places: dict[tuple[int, int, int], list[tuple[tuple[int, int] | None, BufferSlot]]] = {}
    for name, slot in slots.items():
        places.setdefault((slot.allocation, slot.offset, slot.nbytes), []).append(
            (ranges.get(name), slot)
        )
    out = []
    for values in places.values():
        end = None
        for span, slot in sorted(values, key=lambda v: v[0] or (-1, -1)):
            if span is None or end is None or span[0] > end:
                out.append(slot)
            end = None if span is None else max(span[1], end if end is not None else span[1])
    return out


def host_line(host_bytes: int, offloaded: int | None, found: HostBuffers | None) -> str | None:
    """One line when the compiled host bytes differ from the jaxpr's offloaded bytes: both
    figures and what the buffer assignment shows (space reused across buffers not live at
    once; fewer bytes placed on the host than offloaded); None when they agree or a figure is
    missing."""
    if not offloaded or not host_bytes or abs(host_bytes - offloaded) <= _TOLERANCE * offloaded:
        return None
    head = (
        f"host memory: the compiled step holds {format_bytes(host_bytes)} on the host at its "
        f"peak, the jaxpr offloads {format_bytes(offloaded)} in all"
    )
    if found is None:
        return f"{head} (no buffer assignment to tell why)"
    why = []
    if found.buffer_bytes > found.allocated and host_bytes < offloaded:
        why.append(
            f"XLA reuses host space: its {found.count} host buffers "
            f"({format_bytes(found.buffer_bytes)}) share {format_bytes(found.allocated)}, not "
            "being live at once"
        )
    padded = found.buffer_bytes - (found.value_bytes or found.buffer_bytes)
    if host_bytes > offloaded * (1 + _TOLERANCE) and padded > _TOLERANCE * found.buffer_bytes:
        why.append(
            f"the layout pads the host buffers: their values take "
            f"{format_bytes(found.value_bytes or 0)}, their tiled layout "
            f"{format_bytes(found.buffer_bytes)} (a TPU's tile, T(8,128), rounds the two "
            "most-minor dimensions of the layout up to multiples of 8 and 128)"
        )
    if found.buffer_bytes < offloaded * (1 - _TOLERANCE):
        why.append(
            f"only {format_bytes(found.buffer_bytes)} of host buffers in the compiled step: XLA "
            "kept the rest on the device"
        )
    return f"{head}: " + "; ".join(why) if why else head
