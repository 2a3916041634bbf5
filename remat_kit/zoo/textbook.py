"""The textbook per-layer activation memory next to what the compiler keeps.

Korthikanti et al. 2022 (arXiv:2205.05198), Sec. 4.1 and 5: a GPT layer with 16-bit activations,
no tensor or sequence parallelism, keeps

    s*b*h*(34 + 5*a*s/h)  bytes   without recomputation (eq. 1),
    s*b*h*34              bytes   with selective recomputation of the attention core,
    2*s*b*h               bytes   with full recomputation (only the layer input),

(s sequence, b batch, h hidden size, a heads). The compiled figure is the step compiled at ``L1``
and ``L2`` scanned layers:

    per_layer = (live(L2) - live(L1)) / (L2 - L1) - one layer's parameters, optimizer state
                and parameter gradients

where ``live`` is the bytes of the physical buffers live at the peak of XLA's schedule (aliased
values once), both compiles at a 256-token vocabulary (:data:`PROBE_VOCAB`);
``temp_size_in_bytes`` is reported beside it (``compiled_temp_bytes``). The jaxpr figure is
what JAX saves per layer (:func:`remat_kit.zoo.block_residuals`, plus the layer input). Why
live bytes and a small vocabulary: docs/analyze.md ("Per-layer bytes against the textbook").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from remat_kit import targets as T
from remat_kit.memory.api import analyze_policies
from remat_kit.models import ModelConfig
from remat_kit.policies import PolicySpec, get_policy_spec, policy_label
from remat_kit.program import Program
from remat_kit.zoo import PresetLike, as_program, model_residuals

#: Vocabulary of the probe compiles (see the module docstring).
PROBE_VOCAB = 256

#: Policies with a textbook figure: Korthikanti's "no recomputation", "selective" and "full".
TEXTBOOK_POLICIES = ("no-remat", "save-dots-no-batch", "save-nothing", "save-layer-inputs")

_FULL = (
    "full recompute keeps only the layer input, 2sbh, as the textbook says; a larger compiled "
    "figure means the compiler keeps extra per-layer copies (XLA:CPU does; XLA:GPU does not)"
)
_NOTES = {
    "no-remat": (
        "the textbook counts 2-byte activations, dropout and a 4h GELU MLP; XLA keeps the "
        "softmax and the masked scores in float32 and fuses away many elementwise values the "
        "jaxpr lists, so the compiled figure lies between the textbook's and the jaxpr's"
    ),
    "save-dots-no-batch": (
        "the textbook's selective recompute (34sbh) still stores norm outputs, the GELU input "
        "and output and dropout masks; dots-without-batch-dims keeps only the weight-matmul "
        "outputs (q, k, v, out, MLP up: 18sbh for GPT; SwiGLU adds one, GQA shrinks k and v) "
        "and recomputes the rest"
    ),
    "save-nothing": _FULL,
    "save-layer-inputs": _FULL,
}


def korthikanti_bytes(
    seq_len: int, batch_size: int, d_model: int, num_heads: int, policy: str, itemsize: int = 2
) -> int | None:
    """Per-layer activation bytes of Korthikanti et al. 2022 (arXiv:2205.05198) for ``policy``.

    ``no-remat``: ``s*b*h*(34 + 5*a*s/h)``; ``save-dots-no-batch`` (selective recompute):
    ``34*s*b*h``; ``save-nothing`` / ``save-layer-inputs`` (full recompute): ``2*s*b*h``. The
    paper counts 16-bit activations; other ``itemsize`` values scale the figure by
    ``itemsize / 2`` (an approximation: its 1-byte dropout masks do not scale).

    Returns:
      Bytes, or None for a policy the paper has no formula for.

    Example (llama3-8b's block, b=1, s=8192, h=4096, a=32: README's per-layer table)::

        >>> korthikanti_bytes(8192, 1, 4096, 32, "no-remat") / 2**20  # MiB
        11328.0
        >>> korthikanti_bytes(8192, 1, 4096, 32, "save-nothing") / 2**20  # 2*s*b*h
        64.0
        >>> korthikanti_bytes(8192, 1, 4096, 32, "offload-to-host") is None
        True
    """
    s, b, h, a = seq_len, batch_size, d_model, num_heads
    scale = itemsize / 2
    if policy == "no-remat":
        return round(scale * (s * b * h * 34 + 5 * a * s * s * b))
    if policy == "save-dots-no-batch":
        return round(scale * 34 * s * b * h)
    if policy in ("save-nothing", "save-layer-inputs"):
        return round(scale * 2 * s * b * h)
    return None


@dataclasses.dataclass(frozen=True)
class LayerActivations:
    """Per-layer activation bytes: textbook, jaxpr, compiled.

    Attributes:
      model, target, policy, batch_size, seq_len, d_model, num_heads, dtype: what was measured.
      textbook_bytes: :func:`korthikanti_bytes` (None where the paper has no formula).
      jaxpr_bytes: residual bytes JAX saves per layer (device and host), layer input included.
      compiled_bytes: device bytes per layer from two layer counts (module docstring).
      compiled_temp_bytes: the same from XLA's temp allocation size (includes packing).
      compiled_host_bytes: host bytes per layer, the same way.
      ratio: ``compiled_bytes / textbook_bytes``.
      layers: the two layer counts compiled.
      compile_s: seconds of both compiles together.
      note: where and why the compiler departs from the textbook.
    """

    model: str
    target: str
    policy: str
    batch_size: int
    seq_len: int
    d_model: int
    num_heads: int
    dtype: str
    textbook_bytes: int | None
    jaxpr_bytes: int
    compiled_bytes: float
    compiled_temp_bytes: float
    compiled_host_bytes: float
    ratio: float | None
    layers: tuple[int, int]
    compile_s: float
    note: str


def _param_bytes(params) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def per_layer_activations(
    model: Program | PresetLike,
    batch_size: int | None = None,
    seq_len: int | None = None,
    policies: Sequence[str | PolicySpec | Mapping[str, str]] = (
        "no-remat",
        "save-dots-no-batch",
        "save-nothing",
    ),  # fmt: skip
    target: str | T.Target = "local",
    *,
    layers: tuple[int, int] = (2, 4),
    workers: int | None = None,
) -> list[LayerActivations]:
    """The per-layer activation bytes of a bundled model under each policy: Korthikanti's
    formula, JAX's residuals and XLA's compiled figure (two compiles per policy, concurrently).

    Args:
      model: a program :func:`~remat_kit.zoo.preset` built (its batch, sequence, optimizer and
        mesh), or a preset name or config with ``batch_size`` [sequences] and ``seq_len``
        [tokens] (AdamW).
      layers: the two layer counts compiled (scanned; the model's ``remat_group_size`` must
        divide both); keep them small, the figure does not depend on them.

    Raises:
      ValueError: a program the zoo did not build (no textbook formula applies), unknown names,
        non-positive sizes, ``layers`` not two distinct counts.
      CompileError: a compile failed (the message names the policy).
    """
    program = as_program(model, batch_size, seq_len)
    config = program.known.model
    if not isinstance(config, ModelConfig):
        raise ValueError(
            f"per-layer activations need a bundled model (remat_kit.preset); program "
            f"{program.name!r} is not one"
        )
    l1, l2 = layers
    if l1 == l2 or min(l1, l2) <= 0:
        raise ValueError(f"layers must be two distinct positive counts, got {layers}")
    specs = [get_policy_spec(p) for p in policies]
    programs, by_key = {}, {}
    for i, n in enumerate((l1, l2)):
        programs[n] = program.family.build(num_layers=n, scan_layers=True, vocab_size=PROBE_VOCAB)
        reports = analyze_policies(
            programs[n], specs, target, top_k=1, workers=workers,
            compare_offload=False, no_remat_baseline=False,
        )  # fmt: skip
        by_key.update({(j, i): r for j, r in enumerate(reports)})  # two custom specs: one name
    grads = (
        _param_bytes(programs[l2].args[0].params) - _param_bytes(programs[l1].args[0].params)
    ) / (l2 - l1)
    return [
        _layer_row(config, spec, by_key[(j, 0)], by_key[(j, 1)], grads, (l1, l2))
        for j, spec in enumerate(specs)
    ]


def _layer_row(
    config: ModelConfig, spec: PolicySpec, r1, r2, grads: float, layers: tuple[int, int]
) -> LayerActivations:
    """One policy's row from its reports at the two layer counts (``r1``, ``r2``; ``grads``:
    one layer's parameter, optimizer-state and gradient bytes)."""
    batch_size, seq_len = r1.batch_size, r1.seq_len
    dl = layers[1] - layers[0]
    temp = (r2.temp_bytes - r1.temp_bytes) / dl - grads
    if r1.live_peak_bytes is not None and r2.live_peak_bytes is not None:
        live = r2.live_peak_bytes - r1.live_peak_bytes
        compiled = (live - (r2.argument_bytes - r1.argument_bytes)) / dl - grads
    else:
        compiled = temp
    residuals = model_residuals(config.replace(remat_policy=spec), batch_size, seq_len)
    itemsize = jnp.dtype(config.dtype).itemsize
    textbook = korthikanti_bytes(
        seq_len, batch_size, config.d_model, config.num_heads, spec.name, itemsize
    )
    return LayerActivations(
        model=config.name, target=r1.target, policy=policy_label(spec), batch_size=batch_size,
        seq_len=seq_len, d_model=config.d_model, num_heads=config.num_heads, dtype=config.dtype,
        textbook_bytes=textbook,
        jaxpr_bytes=round(sum(r.nbytes for r in residuals) / config.num_layers),
        compiled_bytes=compiled, compiled_temp_bytes=temp,
        compiled_host_bytes=(r2.host_bytes - r1.host_bytes) / dl,
        ratio=compiled / textbook if textbook else None, layers=layers,
        compile_s=round(r1.compile_s + r2.compile_s, 3),
        note=_NOTES.get(spec.name, "no textbook formula for this policy"),
    )  # fmt: skip
