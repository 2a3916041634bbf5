"""A MaxText config as a remat-kit :class:`~remat_kit.program.Program` (:func:`maxtext_program`).

It builds what MaxText's AOT compile (``maxtext/trainers/pre_train/train_compile.py``) compiles:
its model, abstract train state and ``train_step`` on its mesh of the target's devices, figures
per chip. A MaxText ``remat_policy`` name is set as MaxText's override; any other policy is
injected into its ``loss_fn`` (:func:`remat_kit.inject_policy`). docs/maxtext.md.

Example (with maxtext installed)::

    >>> prog = maxtext_program(  # doctest: +SKIP
    ...     "model_name=llama2-7b per_device_batch_size=1 max_target_length=8192", "v5p-8")
    >>> remat_kit.analyze_policies(prog, ["minimal", "full"], target="v5p-8")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import shlex
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from remat_kit import targets as T
from remat_kit import trace
from remat_kit.family import Known
from remat_kit.inject import inject_policy
from remat_kit.placement import BufferNames, Placement
from remat_kit.policies import (
    MAXTEXT_POLICY_NAMES,
    MAXTEXT_TENSORS,
    PolicySpec,
    maxtext_spec,
)
from remat_kit.program import Program
from remat_kit.validation import MissingExtraError
from remat_kit.walker import Residual, saved_residuals

#: MaxText's ``jax_default_prng_impl`` (its ``train.py``); scoped to build and trace here.
PRNG_IMPL = "unsafe_rbg"

INSTALL = 'MaxText is not installed: pip install "remat-kit[maxtext]" (needs Python >= 3.12)'


def _modules() -> types.SimpleNamespace:
    """MaxText's modules, imported on first use.

    Raises:
      MissingExtraError: MaxText is not installed.
    """
    try:  # MaxText's import notes kept off stdout (``--json``)
        with contextlib.redirect_stdout(sys.stderr):
            return _import()
    except ImportError as err:
        raise MissingExtraError(f"{INSTALL} ({err})") from None


def _import() -> types.SimpleNamespace:
    from flax.core.spmd import logical_axis_rules
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    return types.SimpleNamespace(
        pyconfig=pyconfig, train=train, train_compile=train_compile, utils=maxtext_utils,
        sharding=sharding, axis_rules=logical_axis_rules,
    )  # fmt: skip


def split_overrides(overrides: str | Sequence[str]) -> list[str]:
    """MaxText's ``key=value`` overrides as a list (a string split as a shell would).

    Raises:
      ValueError: an item that is not ``key=value``.
    """
    items = shlex.split(overrides) if isinstance(overrides, str) else [str(o) for o in overrides]
    for item in items:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise ValueError(
                f"MaxText override {item!r} is not key=value (e.g. model_name=llama2-7b "
                "per_device_batch_size=1)"
            )
    return items


def _config(mt: types.SimpleNamespace, overrides: Sequence[str]) -> Any:
    """MaxText's config (``pyconfig.initialize``) for ``overrides``, ``XLA_FLAGS`` as it was.

    Raises:
      ValueError: MaxText refused the overrides (its message).
    """
    before = os.environ.get("XLA_FLAGS")
    try:
        return mt.pyconfig.initialize(["train.py", *overrides])
    except SystemExit:  # a bad config, its message logged
        raise ValueError(
            f"MaxText refused the config {' '.join(overrides)!r} (its message is above)"
        ) from None
    except ValueError as err:  # pydantic validation
        raise ValueError(f"MaxText refused the config: {_one_line(err)}") from None
    finally:
        if before is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = before


def _one_line(err: ValueError) -> str:
    """A pydantic error on one line: ``field: message (got value)`` per field."""
    errors = getattr(err, "errors", None)
    if not callable(errors):
        return " ".join(str(err).split())
    parts = []
    for e in errors():
        where = ".".join(str(p) for p in e.get("loc", ())) or "config"
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        parts.append(f"{where}: {e.get('msg', '')}{got}")
    return "; ".join(parts)


def maxtext_candidates(tags: frozenset[str] | set[str]) -> list[PolicySpec]:
    """What ``recommend --maxtext`` searches: MaxText's ``remat_policy`` names whose checkpoint
    names ``tags`` all hold (``minimal``: some), then ``custom`` with its defaults and with each
    emitted tensor kept on device.

    Raises:
      ValueError: ``tags`` holds none of MaxText's tensors (not a MaxText model).
    """
    emitted = [t for t in MAXTEXT_TENSORS if t in tags]
    if not emitted:
        raise ValueError(
            f"the program emits none of MaxText's checkpoint names ({', '.join(sorted(tags))})"
        )
    named = [maxtext_spec(n) for n in MAXTEXT_POLICY_NAMES if n != "custom"]
    out = [s for s in named if s.tags <= tags or (s.name == "minimal" and s.tags & tags)]
    customs = [maxtext_spec("custom")]
    customs += [maxtext_spec("custom", {t: "device"}) for t in emitted]
    for spec in customs:
        if spec not in out:
            out.append(spec)
    return out


def maxtext_name(spec: PolicySpec) -> str | None:
    """``spec``'s MaxText ``remat_policy`` name, or None (the policy is injected)."""
    if spec.name == "custom" or spec.name not in MAXTEXT_POLICY_NAMES:
        return None
    return spec.name if maxtext_spec(spec.name) == spec else None


@dataclasses.dataclass(frozen=True)
class _Built:
    """One MaxText config's graphdef and shardings on the mesh."""

    config: Any
    graphdef: Any
    state_shardings: Any
    params_shardings: Any
    model_graphdef: Any  # the model's, split as the train step splits it (params first)


def _layout(target_name: str, mesh: Any, out_shardings: Any) -> Any:
    """The layout of MaxText's mesh and shardings; ``ValueError`` for another target."""

    def layout(target: T.Target, names: Any) -> Placement:
        if target.name != target_name:
            raise ValueError(
                f"MaxText program was built for target {target_name!r}, not {target.name!r}: "
                "build it for that target (maxtext_program(overrides, target=...))"
            )
        return Placement(tuple, mesh, out_shardings)

    return layout


def _buffer_names(program: Program, rows: Sequence[Any], placement: Placement) -> BufferNames:
    """As :func:`remat_kit.trace.buffer_names`, parameter shapes per chip."""
    names = trace.traced_buffer_names(program, rows)
    params = frozenset((x.dtype.name, tuple(_shard_shape(x))) for x in trace.param_leaves(program))
    return dataclasses.replace(names, params=params)


def _saved(
    program: Program, spec: PolicySpec, *, batch_split: tuple[int, int, int]
) -> list[Residual] | None:
    """What MaxText's loss keeps under ``spec``, per chip: ``[batch, seq]`` values divided over
    the ``activation_batch`` chips (:func:`_per_chip`); others whole (an upper bound)."""
    loss = program.loss(spec)
    if loss is None:
        return None
    saved = list(saved_residuals(loss.fn, *loss.args))
    if batch_split[2] == 1:
        return saved
    return [_per_chip(r, *batch_split) for r in saved]


def maxtext_program(overrides: str | Sequence[str], target: str | T.Target = "local") -> Program:
    """MaxText's training step for ``base.yml`` plus ``overrides`` on its mesh of ``target``.

    Args:
      overrides: ``key=value`` items, a string
        (``"model_name=llama2-7b per_device_batch_size=1"``) or a list; ``remat_policy`` is only
        the default. What remat-kit adds per target: docs/maxtext.md.
      target: a TPU slice (all its chips), a GPU model (one, deviceless) or ``local``.

    Returns:
      A :class:`~remat_kit.program.Program` over MaxText's abstract state (donated) and batch;
      its loss of ``(params, custom_params, rest, batch)`` (:func:`loss_arguments`).

    Raises:
      MissingExtraError: MaxText (Python >= 3.12), libtpu or the CUDA plugin not installed.
      ValueError: an override not ``key=value``; MaxText refusing the config; an unknown
        target.
    """
    mt = _modules()
    tgt = T.get_target(target)
    items = split_overrides(overrides)
    topology = []
    if tgt.tpu is not None:
        topology = [f"compile_topology={tgt.name}", "compile_topology_num_slices=1"]
    given = {item.partition("=")[0] for item in items}
    if tgt.gpu is not None and "hardware" not in given:
        topology.append("hardware=gpu")
    if "skip_jax_distributed_system" not in given:  # one process; docs/maxtext.md
        topology.append("skip_jax_distributed_system=true")
    base = [*items, *topology]
    n = tgt.tpu.num_devices if tgt.tpu is not None else 1 if tgt.gpu is not None else None
    devices = T.compile_devices(tgt, n or len(jax.devices()))
    config = _config(mt, base)
    mesh = _mesh(mt, config, devices)

    @functools.cache
    def built(lines: tuple[str, ...]) -> _Built:
        with jax.default_prng_impl(PRNG_IMPL):
            return _build(mt, _config(mt, [*base, *lines]), mesh)

    with jax.default_prng_impl(PRNG_IMPL):
        first = _build(mt, config, mesh, shaped=True)
    (built_base, (state, batch)) = first

    def step_for(spec: PolicySpec | Callable[..., Any] | None) -> Callable[..., Any]:
        return _step(mt, _choose(spec, built), mesh, spec)

    def loss_for(spec: PolicySpec | Callable[..., Any] | None) -> Callable[..., Any]:
        return _loss(mt, _choose(spec, built), mesh, spec)

    overrides_ = tuple(items)
    known = Known(
        title=f"maxtext {' '.join(overrides_)}",
        cache_key=("maxtext", overrides_, tgt.name),
        takes_spec=True,
        saved=functools.partial(_saved, batch_split=_batch_split(config, mesh)),
        buffer_names=_buffer_names,
    )
    return Program(
        name=f"maxtext {config.model_name}",
        make_step=step_for,
        args=(state, batch),
        donate_argnums=(0,),
        make_loss=loss_for,
        loss_args=loss_arguments(state, batch, config),
        argnums=(0, 1),
        argument_names=("state", "batch"),
        layout=_layout(tgt.name, mesh, (built_base.state_shardings, None)),
        known=known,
    )


def _batch_split(config: Any, mesh: Any) -> tuple[int, int, int]:
    """``(global batch, max_target_length, chips the activation batch is split over)``."""
    axes: Any = ()
    for name, mapped in config.logical_axis_rules:
        if name == "activation_batch":
            axes = mapped
            break
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    shape = dict(mesh.shape)
    chips = math.prod(shape.get(a, 1) for a in axes)
    return int(config.micro_batch_size_to_train_on), int(config.max_target_length), chips


def _shard_shape(x: Any) -> tuple[int, ...]:
    """One chip's shape of an abstract array."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or not hasattr(sharding, "shard_shape"):
        return tuple(x.shape)
    return tuple(sharding.shard_shape(x.shape))


def _per_chip(res: Residual, batch: int, seq: int, chips: int) -> Residual:
    """``res`` with the batch of its first ``[batch, seq]`` pair divided by ``chips``."""
    shape = tuple(res.shape)
    for i in range(len(shape) - 1):
        if shape[i : i + 2] == (batch, seq) and batch % chips == 0:
            part = (*shape[:i], batch // chips, *shape[i + 1 :])
            return dataclasses.replace(res, shape=part, nbytes=res.nbytes // chips)
    return res


def _mesh(mt: types.SimpleNamespace, config: Any, devices: Sequence[Any]) -> Any:
    """MaxText's mesh (``train_compile.get_topology_mesh``) over ``devices``."""
    from jax.sharding import AxisType, Mesh

    jax.config.update(
        "jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type
    )
    explicit = str(getattr(config.shard_mode, "value", config.shard_mode)) == "explicit"
    kind = AxisType.Explicit if explicit else AxisType.Auto
    grid = mt.utils.create_device_mesh(config, list(devices))
    return Mesh(grid, config.mesh_axes, axis_types=(kind,) * len(config.mesh_axes))


def _build(mt: types.SimpleNamespace, config: Any, mesh: Any, shaped: bool = False) -> Any:
    """MaxText's graphdef and shardings for ``config``; ``shaped``: with the abstract args."""
    from flax import nnx

    args, _, state_sh, _, graphdef = mt.train_compile.get_shaped_inputs(mesh, config)
    params_sh, state_sh = mt.sharding.maybe_update_params_sharding_with_opt(config, state_sh)
    input_sh = mt.sharding.build_zero1_input_state_mesh_shardings(config, state_sh, params_sh)
    model = nnx.merge(graphdef, args[0]).model  # abstract
    model_graphdef = nnx.split(model, *_param_filters(config))[0]
    built = _Built(config, graphdef, input_sh, params_sh, model_graphdef)
    return (built, tuple(args)) if shaped else built


def _choose(spec: Any, built: Callable[[tuple[str, ...]], _Built]) -> _Built:
    """The config for ``spec``: its MaxText name, else ``remat_policy=full`` (then injected)."""
    name = maxtext_name(spec) if isinstance(spec, PolicySpec) else None
    if name is not None:
        return built((f"remat_policy={name}",))
    return built(("remat_policy=full",))


@contextlib.contextmanager
def _tracing(mt: types.SimpleNamespace, config: Any, mesh: Any) -> Iterator[None]:
    """The abstract mesh, MaxText's axis rules and PRNG; on GPU, tokamax's ``cross_compile`` (its
    flash attention kernel refuses to trace deviceless otherwise)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
        stack.enter_context(mt.axis_rules(config.logical_axis_rules))
        stack.enter_context(jax.default_prng_impl(PRNG_IMPL))
        if _platform(mesh) == "gpu":
            from tokamax import config as tokamax_config

            stack.enter_context(tokamax_config.cross_compile(True))
        yield


def _platform(mesh: Any) -> str:
    """The mesh's platform as MaxText's ``hardware`` names it."""
    platform = str(mesh.devices.flat[0].platform).lower()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def _step(mt: types.SimpleNamespace, built: _Built, mesh: Any, spec: Any):
    """MaxText's ``train_step`` (:func:`_tracing`), ``loss_fn`` injected where ``spec`` is not
    a MaxText name."""
    train_step = mt.train.train_step
    if not isinstance(spec, PolicySpec) or maxtext_name(spec) is None:
        policy = spec if not isinstance(spec, PolicySpec) else spec.to_jax() if spec.wrap else None
        scope = {**train_step.__globals__, "loss_fn": _injected(mt.train.loss_fn, policy)}
        train_step = types.FunctionType(
            train_step.__code__, scope, train_step.__name__, train_step.__defaults__,
            train_step.__closure__,
        )  # fmt: skip
    config = built.config

    def step(state: Any, batch: Any) -> Any:
        with _tracing(mt, config, mesh):
            return train_step(
                built.graphdef, config, built.state_shardings, built.params_shardings, state, batch
            )

    step.__name__ = "train_step"
    return step


def _param_filters(config: Any) -> tuple[Any, Any, Any]:
    """MaxText ``train_step``'s model split: trained params (LoRA too),
    ``_overwrite_with_gradient`` variables, the rest."""
    from flax import nnx
    from flax.nnx import variablelib

    owg = variablelib.variable_type_from_name("_overwrite_with_gradient", allow_register=True)
    lora = getattr(getattr(config, "lora", None), "enable_lora", False)
    trained = getattr(nnx, "LoRAParam", nnx.Param) if lora else nnx.Param
    return trained, nnx.Any(owg), ...


def loss_arguments(state: Any, batch: Any, config: Any) -> tuple[Any, Any, Any, Any]:
    """``(params, custom_params, rest, batch)`` split by :func:`_param_filters`: the loss's
    arguments."""
    from flax import nnx

    params, custom, rest = nnx.split_state(state["model"], *_param_filters(config))
    return params, custom, rest, batch


def _loss(mt: types.SimpleNamespace, built: _Built, mesh: Any, spec: Any):
    """What ``train_step`` differentiates (its ``diff_wrapper``), aux dropped; injected as in
    :func:`_step`."""
    from flax import nnx

    loss_fn = mt.train.loss_fn
    if not isinstance(spec, PolicySpec) or maxtext_name(spec) is None:
        policy = spec if not isinstance(spec, PolicySpec) else spec.to_jax() if spec.wrap else None
        loss_fn = _injected(loss_fn, policy)
    config = built.config

    def loss(params: Any, custom_params: Any, rest: Any, batch: Any) -> Any:
        with _tracing(mt, config, mesh):
            model = nnx.merge(built.model_graphdef, params, custom_params, rest, copy=True)
            value, _ = loss_fn(model, config, dict(batch), None, None, is_train=True)
            return value

    return loss


def _injected(loss_fn: Callable[..., Any], policy: Any) -> Callable[..., Any]:
    """``loss_fn`` with ``policy`` in each remat segment (None: no remat), model updates written
    back."""
    from flax import nnx

    def injected(model: Any, config: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        graphdef, state = nnx.split(model)

        def pure(state: Any, data: Any) -> Any:
            inner = nnx.merge(graphdef, state)
            out = loss_fn(inner, config, data, *args, **kwargs)
            return out, nnx.state(inner)

        out, new_state = inject_policy(pure)(policy)(state, data)
        nnx.update(model, new_state)
        return out

    return injected


__all__ = [
    "INSTALL",
    "maxtext_candidates",
    "maxtext_name",
    "maxtext_program",
    "split_overrides",
]
