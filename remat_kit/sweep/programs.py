"""Run a user's :class:`~remat_kit.program.Program` on the local device: its step's arguments
(the program's own arrays, or materialised from its abstract shapes), compiled once per policy,
timed step by step with the donated state fed back."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from remat_kit.program import Program, Pure
from remat_kit.sweep.measure import measured_peak, peak_bytes_in_use

#: Seed of the values given to abstract float arguments (the same for every policy and run).
ARGUMENT_SEED = 0
#: Scale of those values: ``|N(0, 1)| * ARGUMENT_SCALE``.
ARGUMENT_SCALE = 0.02
#: How abstract arguments are given values (stored in each row's ``arguments_note``).
MATERIALISED_NOTE = (
    f"abstract (ShapeDtypeStruct) leaves materialised: float ones {ARGUMENT_SCALE} x |N(0, 1)| "
    f"from jax.random.key({ARGUMENT_SEED}) (non-negative, so an optimizer's second moments stay "
    f"valid), integer and boolean ones zeros, PRNG keys split from key({ARGUMENT_SEED})"
)


@dataclasses.dataclass(frozen=True)
class HostArguments:
    """The step's arguments as host (numpy) arrays, the same for every policy.

    Attributes:
      values: the pure step's arguments (``args`` of :class:`remat_kit.program.Pure`): numpy leaves,
        :class:`HostKey` for typed PRNG keys (:func:`device_arguments` places them).
      source: ``"concrete"`` (the program's own arrays), ``"materialised"`` (every array leaf
        was a ``ShapeDtypeStruct``) or ``"partly materialised"``.
      note: how abstract leaves got their values (None when there were none).
    """

    values: tuple[Any, ...]
    source: str
    note: str | None


@dataclasses.dataclass(frozen=True)
class HostKey:
    """A typed PRNG key array kept on the host: its raw data and its implementation."""

    data: np.ndarray
    impl: Any


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_host(x: Any) -> Any:
    if _is_key(x):
        return HostKey(np.asarray(jax.random.key_data(x)), jax.random.key_impl(x))
    return np.asarray(jax.device_get(x))


def device_arguments(values: Any) -> Any:
    """Fresh device copies of host arguments (numpy leaves and :class:`HostKey` s), which a
    step may donate without touching ``values``."""

    def place(x: Any) -> Any:
        if isinstance(x, HostKey):
            return jax.random.wrap_key_data(jnp.asarray(x.data), impl=x.impl)
        return jax.device_put(x) if isinstance(x, np.ndarray) else x

    return jax.block_until_ready(
        jax.tree.map(place, values, is_leaf=lambda x: isinstance(x, HostKey))
    )


def argument_signature(host: HostArguments) -> list[list[Any]]:
    """``[shape, dtype]`` of every leaf of ``host`` (a key: its raw data's, dtype ``key<impl>``;
    a non-array leaf: its type), for telling whether two runs had the same arguments."""

    def one(x: Any) -> list[Any]:
        if isinstance(x, HostKey):
            return [list(x.data.shape), f"key<{x.impl}>"]
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return [list(x.shape), str(x.dtype)]
        return [None, type(x).__name__]

    return [one(x) for x in jax.tree.leaves(host.values, is_leaf=lambda x: isinstance(x, HostKey))]


def _materialise(leaf: jax.ShapeDtypeStruct, key: jax.Array) -> Any:
    """Values for an abstract leaf (see :data:`MATERIALISED_NOTE`); keys from the fixed seed."""
    dtype = leaf.dtype
    if _is_key(leaf):  # keys of the argument's own implementation, split from the fixed seed
        n = math.prod(leaf.shape)
        impl = str(dtype).removeprefix("key<").removesuffix(">")  # key<rbg>; key<fry>: default
        try:
            base = jax.random.key(ARGUMENT_SEED, impl=impl)
        except ValueError:  # a short name jax.random.key does not take (fry: threefry2x32)
            base = key
        return _to_host(jax.random.split(base, max(1, n))[:n].reshape(leaf.shape))
    if jnp.issubdtype(dtype, jnp.inexact):
        values = jnp.abs(jax.random.normal(key, leaf.shape, jnp.float32)) * ARGUMENT_SCALE
        return np.asarray(values.astype(dtype))
    return np.zeros(leaf.shape, dtype)


def host_arguments(pure: Pure) -> HostArguments:
    """The arguments of ``pure`` (a program's step under any policy: the arguments do not depend
    on it) on the host, abstract leaves materialised (see :data:`MATERIALISED_NOTE`); the note
    names the arguments that had them (``opt_state filled in: ...``)."""
    seed_keys = iter(jax.random.split(jax.random.key(ARGUMENT_SEED), max(1, _count(pure.args))))
    values, filled, arrays, abstract = [], [], 0, 0
    for i, arg in enumerate(pure.args):
        leaves, treedef = jax.tree.flatten(arg)
        out, n = [], 0
        for leaf in leaves:
            key = next(seed_keys)
            if isinstance(leaf, jax.ShapeDtypeStruct):
                out.append(_materialise(leaf, key))
                n += 1
            elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                out.append(_to_host(leaf))
            else:
                out.append(leaf)
        arrays += sum(hasattr(x, "shape") for x in leaves)
        abstract += n
        if n:
            filled.append(pure.names[i] if i < len(pure.names) else f"argument {i}")
        values.append(jax.tree.unflatten(treedef, out))
    source = "concrete" if not abstract else "materialised" if abstract == arrays else (
        "partly materialised")  # fmt: skip
    note = f"{', '.join(filled)} filled in: {MATERIALISED_NOTE}" if abstract else None
    return HostArguments(tuple(values), source, note)


def _count(args: Any) -> int:
    return len(jax.tree.leaves(args))


def _signature(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves if hasattr(x, "shape"))


def _candidates(tree: Any, path: tuple = (), depth: int = 3):
    """``(path, subtree)`` of ``tree`` and of its tuple / list / dict members, pre-order."""
    yield path, tree
    if depth == 0 or not isinstance(tree, (tuple, list, dict)):
        return
    for k, sub in tree.items() if isinstance(tree, dict) else enumerate(tree):
        yield from _candidates(sub, (*path, k), depth - 1)


def _get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def feedback_paths(args: Sequence[Any], out: Any, donated: Sequence[int]) -> dict[int, tuple]:
    """Where, in the step's output ``out``, the updated value of each donated argument is: the
    first unclaimed subtree (pre-order, through tuples, lists and dicts) with the argument's
    tree structure, shapes and dtypes. Donated arguments with no such subtree are left out.

    Args:
      args: the step's arguments (arrays or ``ShapeDtypeStruct`` s).
      out: its output (arrays or ``ShapeDtypeStruct`` s, e.g. from ``jax.eval_shape``).
      donated: the donated argument positions.
    """
    found: dict[int, tuple] = {}
    claimed: list[tuple] = []
    for i in donated:
        want = _signature(args[i])
        for path, sub in _candidates(out):
            overlaps = any(path[: len(c)] == c or c[: len(path)] == path for c in claimed)
            if not overlaps and _signature(sub) == want:
                found[i] = path
                claimed.append(path)
                break
    return found


def loss_path(out: Any, claimed: Sequence[tuple]) -> tuple | None:
    """The path of the step's loss in ``out``: its only float scalar outside the updated state
    (``claimed``), or a ``"loss"`` entry of a dict; None when there is none or several."""
    scalars = []
    for path, sub in _candidates(out):
        if any(path[: len(c)] == c for c in claimed):
            continue
        if path and path[-1] == "loss" and hasattr(sub, "shape") and sub.shape == ():
            return path
        if hasattr(sub, "dtype") and sub.shape == () and jnp.issubdtype(sub.dtype, jnp.inexact):
            scalars.append(path)
    return scalars[0] if len(scalars) == 1 else None


def lower_step(program: Program, pure: Pure, host: HostArguments) -> Any:
    """``pure`` jitted with the program's donated arguments and lowered for the local device on
    the host arguments' shapes (compile it with ``.compile()``)."""
    jitted = jax.jit(pure.fn, donate_argnums=program.donated(pure))
    return jitted.lower(*device_arguments(host.values))


def run_program_step(
    program: Program,
    pure: Pure,
    compiled: Any,
    host: HostArguments,
    warmup_steps: int,
    timed_steps: int,
) -> dict[str, Any]:
    """Run ``warmup_steps`` untimed then ``timed_steps`` timed steps of ``compiled`` (the
    program's step under one policy), each ended by ``jax.block_until_ready``.

    The arguments start from ``host`` (copied to the device for this policy). A donated
    argument is fed the step's updated value of it (:func:`feedback_paths`); one whose update
    the output does not hold is copied from the host again before each step, outside the timer.

    Returns:
      ``step_times_s`` (wall seconds of the timed steps) and ``step_time_s`` (their median),
      ``step_cpu_times_s`` / ``step_cpu_s`` (process CPU seconds, all threads), ``losses``
      (every step's loss, or None when the step returns no single float scalar),
      ``measured_peak_bytes`` (bytes, or None: see ``measured_peak_note``), ``fed_back`` (names
      of the donated arguments fed the step's output) and ``recopied`` (those copied again).

    Raises:
      FloatingPointError: a loss was not finite.
      Whatever JAX raises (out of memory: ``XlaRuntimeError`` ``RESOURCE_EXHAUSTED``).
    """
    donated = program.donated(pure)
    args = list(device_arguments(host.values))
    shapes = jax.eval_shape(pure.fn, *args)
    paths = feedback_paths(args, shapes, donated)
    loss_at = loss_path(shapes, list(paths.values()))
    recopy = [i for i in donated if i not in paths]
    before = peak_bytes_in_use()
    losses, times, cpu_times = [], [], []
    for i in range(warmup_steps + timed_steps):
        for j in recopy if i else ():
            args[j] = device_arguments(host.values[j])
        start, cpu_start = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(compiled(*args))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        for j, path in paths.items():
            args[j] = _get(out, path)
        if loss_at is not None:
            loss = float(_get(out, loss_at))
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss at step {i} is {loss}")
            losses.append(loss)
        if i >= warmup_steps:
            times.append(elapsed)
            cpu_times.append(cpu)
    del args, out
    return {
        "step_times_s": [round(t, 6) for t in times],
        "step_time_s": statistics.median(times),
        "step_cpu_times_s": [round(t, 6) for t in cpu_times],
        "step_cpu_s": statistics.median(cpu_times),
        "losses": losses if loss_at is not None else None,
        **measured_peak(before),
        "fed_back": [pure.names[j] for j in sorted(paths)],
        "recopied": [pure.names[j] for j in recopy],
    }
