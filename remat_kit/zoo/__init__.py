"""The bundled models as ordinary :class:`~remat_kit.program.Program` values.

:func:`preset` turns a preset name or :class:`~remat_kit.models.ModelConfig` into a program whose
step is :func:`remat_kit.make_train_step` on abstract arguments (``jax.eval_shape``: nothing
allocated). Beside the factories (:mod:`remat_kit.family`): ``known`` (the factories take the
:class:`~remat_kit.policies.PolicySpec`; residuals from one traced segment,
:func:`model_residuals`), ``layout`` (a (dp, fsdp, tp) mesh) and ``family`` (the model at other
shapes or structure, for recommend's searches). :mod:`remat_kit.program` imports nothing from here.

Example::

    >>> prog = preset("tiny-gpt", batch_size=2, seq_len=32)
    >>> prog.title, prog.argument_names
    ('tiny-gpt b=2 s=32', ('state', 'batch'))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from remat_kit import targets as T
from remat_kit.family import Family, Known, Structure
from remat_kit.models import (
    PRESETS,
    BlockGroup,
    ModelConfig,
    attention_choices,
    get_config,
    sqrt_groups,
)
from remat_kit.names import CHECKPOINT_SHAPES
from remat_kit.optimizers import make_optimizer
from remat_kit.placement import BufferNames, Placement
from remat_kit.policies import PolicySpec
from remat_kit.program import Program
from remat_kit.pure import Pure
from remat_kit.reach import PolicyReach
from remat_kit.training.step import (
    abstract_batch,
    abstract_train_state,
    loss_fn,
    make_train_step,
    sharded_train_state,
)
from remat_kit.validation import check_batch_split, check_seq_len, positive_int
from remat_kit.walker import Residual, TagResiduals, group_by_tag, saved_residuals

#: A preset name (``"llama3-8b"``) or :class:`~remat_kit.models.ModelConfig` (:func:`as_program`).
PresetLike = str | ModelConfig

#: Changes of :attr:`Program.family` that are shapes, not model fields.
_SHAPE_FIELDS = ("batch_size", "seq_len")


def _title(config: ModelConfig, batch_size: int, seq_len: int) -> str:
    return f"{config.name} b={batch_size} s={seq_len}"


def _baseline(program: Program, config: ModelConfig, tx: optax.GradientTransformation) -> Pure:
    """The plain step (no remat, no nested scan, whole logits), same ``attention``."""
    plain = config.replace(
        remat_policy="no-remat", remat_layers=None, nested_remat=False, nested_groups=None,
        loss_chunk_size=None,
    )  # fmt: skip
    # A layer structure stacks its parameters differently: the plain step's own state.
    state = program.args[0]
    if config.layer_structure:
        state = abstract_train_state(plain, tx)
    step = make_train_step(plain, tx, jit=False)
    return Pure(step, (state, program.args[1]), program.argument_names, None)


def _mesh_layout(
    config: ModelConfig, tx: optax.GradientTransformation, batch: Any, mesh: T.MeshSpec
) -> Any:
    """The train state sharded over the mesh (:func:`remat_kit.training.sharded_train_state`),
    the batch over dp*fsdp."""

    def layout(target: T.Target, names: Any) -> Placement:
        devices = T.make_mesh(mesh, T.compile_devices(target, mesh.num_devices))
        state, _ = sharded_train_state(config, tx, devices)
        placed = T.abstractify(batch, T.batch_sharding(devices))
        return Placement(lambda args: (state, placed), devices)

    return layout


def _residuals(
    program: Program, spec: PolicySpec, placement: Placement, *, config: ModelConfig,
    batch_size: int, seq_len: int,
) -> tuple[TagResiduals, ...]:  # fmt: skip
    """:func:`model_residuals` per device (batch over dp*fsdp, tagged dimensions over tp)."""
    shape = dict(placement.mesh.shape) if placement.mesh is not None else {}
    split = shape.get("dp", 1) * shape.get("fsdp", 1)
    remat = config.replace(remat_policy=spec)
    return model_residuals(remat, batch_size // split, seq_len, shape.get("tp", 1))


def _buffer_names(
    program: Program, rows: Any, placement: Placement, *, config: ModelConfig,
    batch_size: int, seq_len: int,
) -> BufferNames:  # fmt: skip
    """Residual rows [segments, *row shape], the parameters' shapes, and the logits."""
    segments = config.num_layers // config.remat_group_size
    stacked: dict[tuple[str, tuple[int, ...]], tuple[str, ...]] = {}
    for row in rows:
        key = (row.dtype, (segments, *row.shape))
        stacked[key] = (*stacked.get(key, ()), row.tag)
    params = frozenset(
        (jax.numpy.dtype(x.dtype).name, tuple(x.shape))
        for x in jax.tree.leaves(program.args[0].params)
    )
    return BufferNames(stacked, params, logits_elems=batch_size * seq_len * config.vocab_size)


def _saved(
    program: Program, spec: PolicySpec, *, config: ModelConfig, batch_size: int, seq_len: int
) -> list[Residual]:
    """One remat segment's kept values (:func:`block_residuals`)."""
    return list(block_residuals(config.replace(remat_policy=spec), batch_size, seq_len))


def preset_name(config: ModelConfig) -> str | None:
    """``config.name`` where ``get_config(name, ...)`` rebuilds ``config``; else None."""
    known = PRESETS.get(config.name)
    if known is None:
        return None
    remat = ("remat_policy", "remat_group_size", "scan_layers", "attention", "loss_chunk_size")
    same = config.replace(**{f: getattr(known, f) for f in remat})
    return config.name if same == known else None


def nested_groups(config: ModelConfig) -> int | None:
    """Outer group count for nested remat (:func:`sqrt_groups`), or None where it does not apply
    (already nested, not a per-layer scan, partial-layer remat, no divisor in (1, L))."""
    ok = config.scan_layers and config.remat_group_size == 1 and not config.layer_structure
    groups = sqrt_groups(config.num_layers)
    return groups if ok and 1 < groups < config.num_layers else None


def structure(config: ModelConfig) -> Structure:
    """The config's layer structure as recommend's searches read it."""
    return Structure(
        num_layers=config.num_layers, remat_group_size=config.remat_group_size,
        scan_layers=config.scan_layers, attention=config.attention,
        loss_chunk_size=config.loss_chunk_size, remat_layers=config.remat_layers,
        nested_groups=config.outer_groups, name=preset_name(config),
    )  # fmt: skip


def family(
    config: ModelConfig,
    batch_size: int,
    seq_len: int,
    optimizer: str | optax.GradientTransformation,
    mesh: T.MeshSpec | None,
) -> Family:
    """The preset's family: ``build(batch_size=, seq_len=, **ModelConfig fields)`` (errors as
    :func:`preset`)."""

    def build(**changes: Any) -> Program:
        shape = {k: changes.pop(k) for k in _SHAPE_FIELDS if k in changes}
        changed = config.replace(**changes) if changes else config
        b, s = shape.get("batch_size", batch_size), shape.get("seq_len", seq_len)
        return preset(changed, b, s, optimizer, mesh)

    return Family(
        build=build,
        structure=structure(config),
        accepts=frozenset({*_SHAPE_FIELDS, *(f.name for f in dataclasses.fields(ModelConfig))}),
        attention_options=lambda target: attention_choices(target, config),
        nested_groups=nested_groups(config),
    )


def _known(
    config: ModelConfig,
    batch_size: int,
    seq_len: int,
    optimizer: str | optax.GradientTransformation,
    mesh: T.MeshSpec | None,
    tx: optax.GradientTransformation,
) -> Known:
    """What the zoo knows of a preset's program (see the module docstring)."""
    rules = dict(config=config, batch_size=batch_size, seq_len=seq_len)
    segments = config.num_layers // config.remat_group_size
    named = isinstance(optimizer, str)  # an optax transformation object is not describable
    key = ("preset", config, batch_size, seq_len, optimizer, str(mesh) if mesh else None)
    return Known(
        title=_title(config, batch_size, seq_len),
        batch_size=batch_size,
        seq_len=seq_len,
        optimizer=optimizer if named else None,
        mesh=mesh,
        logits=((batch_size, seq_len, config.vocab_size), config.dtype),
        scan_layers=config.scan_layers,
        default_policy=config.remat_policy,
        cache_key=key if named else None,
        takes_spec=True,
        reach=PolicyReach(config.name, segments, segments, 0),
        baseline=functools.partial(_baseline, config=config, tx=tx),
        saved=functools.partial(_saved, **rules),
        residuals=functools.partial(_residuals, **rules),
        buffer_names=functools.partial(_buffer_names, **rules),
        model=config,
    )


def preset(
    model: str | ModelConfig,
    batch_size: int,
    seq_len: int,
    optimizer: str | optax.GradientTransformation = "adamw",
    mesh: str | T.MeshSpec | None = None,
    **changes: Any,
) -> Program:
    """A bundled model's training step as a program every tool takes.

    Args:
      model: a preset name (``"llama3-8b"``, see :func:`remat_kit.preset_names`) or a
        :class:`~remat_kit.models.ModelConfig`.
      batch_size: sequences per step (global; on a mesh split over dp*fsdp).
      seq_len: tokens per sequence.
      optimizer: a :func:`remat_kit.make_optimizer` name or an optax transformation.
      mesh: ``"fsdp=8"`` or a :class:`~remat_kit.targets.MeshSpec`; figures per device.
      changes: :class:`~remat_kit.models.ModelConfig` fields changed.

    Raises:
      ValueError: unknown preset, field or optimizer; ``batch_size`` / ``seq_len`` not positive
        integers; ``seq_len`` above the model's ``max_seq_len``; a batch that dp*fsdp does not
        divide; a bad mesh.
    """
    if not isinstance(model, (str, ModelConfig)):
        raise ValueError(f"model must be a preset name or a ModelConfig, got {model!r}")
    config = get_config(model, **changes)
    positive_int("batch_size", batch_size)
    check_seq_len(seq_len, config.max_seq_len, config.name)
    spec = T.parse_mesh(mesh) if mesh is not None else None
    if spec is not None:
        check_batch_split(batch_size, spec.dp * spec.fsdp, mesh=str(spec))
    tx = make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
    state = abstract_train_state(config, tx)
    batch = abstract_batch(batch_size, seq_len)

    def make_step(spec: PolicySpec):
        return make_train_step(config.replace(remat_policy=spec), tx, jit=False)

    def make_loss(spec: PolicySpec):
        remat = config.replace(remat_policy=spec)

        def loss(params, batch):
            return loss_fn(params, remat, batch)

        return loss

    known = _known(config, batch_size, seq_len, optimizer, spec, tx)
    return Program(
        name=config.name,
        make_step=make_step,
        args=(state, batch),
        donate_argnums=(0,),
        make_loss=make_loss,
        loss_args=(state.params, batch),
        argnums=(0,),
        argument_names=("state", "batch"),
        layout=_mesh_layout(config, tx, batch, spec) if spec is not None else None,
        known=known,
        family=family(config, batch_size, seq_len, optimizer, spec),
    )


def check_preset(
    model: PresetLike, seq_len: int | None = None, how: str | None = None, **changes: Any
) -> PolicySpec | str:
    """Check, building nothing, that the preset with ``changes`` exists and holds ``seq_len``
    (``how``: how the user raises ``max_seq_len``, for the error).

    Returns:
      The remat policy the preset is configured with.

    Raises:
      ValueError: an unknown preset or field, a bad value, ``seq_len`` above ``max_seq_len``.
    """
    config = get_config(model, **changes)
    if seq_len is not None:
        check_seq_len(seq_len, config.max_seq_len, config.name, how=how)
    return config.remat_policy


def model_residuals(
    config: ModelConfig, batch_size: int, seq_len: int, tp: int = 1
) -> tuple[TagResiduals, ...]:
    """The model's saved residuals under ``config``'s policy by tag: one remat segment
    (:func:`block_residuals`, segment input included) times ``num_layers // remat_group_size``.

    A structured config (``remat_layers``, ``nested_remat``, ``loss_chunk_size``) reads the whole
    loss's VJP instead (:func:`remat_kit.walker.saved_residuals`), rows stacked ([layers, batch,
    seq, d_model]). Untagged residuals are grouped as ``"<primitive>"``.

    Args:
      batch_size: sequences (per device under data parallelism).
      tp: tensor-parallel degree; rows per device (:func:`split_over_tp`).

    Raises:
      ValueError: ``tp`` is not a positive integer.
    """
    if config.layer_structure or config.loss_chunk_size is not None:
        state = abstract_train_state(config, make_optimizer("sgd"))
        whole = saved_residuals(
            lambda p, b: loss_fn(p, config, b), state.params, abstract_batch(batch_size, seq_len)
        )
        kept = [r for r in whole if not r.is_argument]
        return tuple(group_by_tag(split_over_tp(kept, tp)))
    segments = config.num_layers // config.remat_group_size
    rows = []
    kept = [
        r
        for r in block_residuals(config, batch_size, seq_len)
        if not r.is_argument or r.source == "argument [1]"
    ]
    for row in group_by_tag(split_over_tp(kept, tp), include_arguments=True):
        rows.append(
            dataclasses.replace(row, count=row.count * segments, nbytes=row.nbytes * segments)
        )
    return tuple(rows)


def as_program(
    model: Program | PresetLike,
    batch_size: int | None = None,
    seq_len: int | None = None,
    optimizer: str | optax.GradientTransformation | None = None,
    mesh: str | T.MeshSpec | None = None,
    *,
    default_shape: tuple[int, int] | None = None,
) -> Program:
    """A tool's ``model`` argument as a Program (a preset through :func:`preset`);
    ``default_shape``: (batch, seq) for a preset given without them.

    Raises:
      ValueError: shapes, optimizer or mesh given with a Program; for a preset, a missing
        ``batch_size`` / ``seq_len`` and what :func:`preset` raises.
    """
    given = {"batch_size": batch_size, "seq_len": seq_len, "optimizer": optimizer, "mesh": mesh}
    if isinstance(model, Program):
        extra = [k for k, v in given.items() if v is not None]
        if extra:
            raise ValueError(
                f"{', '.join(extra)} apply to presets; program {model.name!r} carries its own "
                "arguments (set their shapes and its optimizer in its factory)"
            )
        return model
    if default_shape is not None:
        given["batch_size"] = batch_size or default_shape[0]
        given["seq_len"] = seq_len or default_shape[1]
    for name in ("batch_size", "seq_len"):
        if given[name] is None:
            raise ValueError(f"{name} is required for preset {model!r}")
    return preset(model, given["batch_size"], given["seq_len"], optimizer or "adamw", mesh)


#: The dimension names of :mod:`remat_kit.names` -> the models' logical axis names.
_DIM_AXES = {
    "batch": "batch", "seq": "seq", "d_model": "embed", "heads": "heads", "kv_heads": "kv_heads",
    "head_dim": "head_dim", "d_ff": "mlp", "q_lora_rank": "q_lora", "kv_lora_rank": "kv_lora",
}  # fmt: skip


def block_residuals(config: ModelConfig, batch_size: int, seq_len: int) -> list[Residual]:
    """Residuals of one remat segment under the config's policy, traced on abstract shapes:
    input x [batch, seq, d_model]; later blocks' inputs tagged ``decoder_layer_input``."""
    x = jax.ShapeDtypeStruct((batch_size, seq_len, config.d_model), config.compute_dtype)
    positions = jnp.arange(seq_len, dtype=jnp.int32)
    group = BlockGroup(config)
    params = jax.eval_shape(lambda: group.init(jax.random.key(0), x, positions)["params"])

    def segment(p, h, pos):
        return group.apply({"params": p}, h, pos)[0]

    spec = config.policy_spec
    if spec.wrap:
        segment = jax.checkpoint(segment, policy=spec.to_jax())
    pos_spec = jax.ShapeDtypeStruct((seq_len,), jnp.int32)
    return saved_residuals(segment, params, x, pos_spec)


def tag_axes(tag: str) -> tuple[str, ...] | None:
    """Logical axes of a tag (:data:`remat_kit.names.CHECKPOINT_SHAPES`); None if unknown."""
    dims = CHECKPOINT_SHAPES.get(tag)
    return None if dims is None else tuple(_DIM_AXES[d] for d in dims)


def tp_split_axes() -> frozenset[str]:
    """Logical axes split over ``tp`` (:data:`remat_kit.targets.LOGICAL_RULES`)."""
    return frozenset(axis for axis, mesh in T.LOGICAL_RULES if mesh == "tp")


def split_over_tp(residuals: list[Residual], tp: int) -> list[Residual]:
    """Per-device residuals under ``tp``-way tensor parallelism.

    A tagged residual with an axis mapped to ``tp`` (:func:`tag_axes`) keeps ``1/tp`` of it per
    device, as its projection's weight is split (Megatron-LM, Shoeybi et al. 2019,
    arXiv:1909.08053); FSDP keeps [batch, seq, d_model] activations whole. Residuals of unknown
    axes are kept as they are.

    Returns:
      The residuals with per-device shapes and ``nbytes``, in the same order.

    Raises:
      ValueError: ``tp`` is not a positive integer.
    """
    positive_int("tp", tp)
    if tp == 1:
        return list(residuals)
    split = tp_split_axes()
    out = []
    for r in residuals:
        axes = tag_axes(r.tag) if r.tag is not None else None
        if axes is None or len(axes) != len(r.shape) or not split.intersection(axes):
            out.append(r)
            continue
        shape = tuple(-(-d // tp) if a in split else d for d, a in zip(r.shape, axes, strict=True))
        nbytes = math.prod(shape) * jnp.dtype(r.dtype).itemsize
        out.append(dataclasses.replace(r, shape=shape, nbytes=nbytes))
    return out
