"""Figures for issue 17: partial-layer and nested remat, chunked cross-entropy.

Command (CPU machine; the H100 target compiles deviceless with the CUDA plugin)::

    JAX_PLATFORMS=cpu python experiments/bench_structure.py --part llama        # ~9 min
    JAX_PLATFORMS=cpu python experiments/bench_structure.py --part llama-cudnn  # ~5 min
    JAX_PLATFORMS=cpu python experiments/bench_structure.py --part chen         # ~9 min
    (``--part all``: the three; ``--part traced``: recompute the traced FLOPs ratios of an
    existing ``llama3-8b.jsonl`` without compiling; ``--out DIR`` elsewhere than below.)

Writes ``experiments/results/structure/``:

- ``llama3-8b.jsonl`` (xla attention) and ``llama3-8b-cudnn.jsonl`` (cuDNN flash attention):
  llama3-8b shapes (32 layers), b=1, s=8192, bf16 params + AdamW, h100-sxm: per-layer vs nested
  vs partial remat, whole vs chunked logits. One row per variant: compiled peak, temp and
  argument bytes; stored residual bytes (the forward's saved values, from the jaxpr of the
  loss's VJP: :func:`remat_kit.walker.saved_residuals`) and the part of them stacked with
  per-layer shape [b, s, h] (layer inputs, outer carries); bytes of logits-sized buffers live at
  XLA's peak; FLOPs ratios over the traced no-remat step with the same attention:
  ``flops_ratio`` (compiled matmul FLOPs: XLA's own rematerialisation included) and
  ``flops_ratio_traced`` (the step's jaxpr: JAX remat only). cuDNN attention's FLOPs are in
  neither (a custom call, not a dot).
- ``chen.jsonl``: Chen et al. 2016's trend: a small-width model (d_model 256, cuDNN attention,
  b=8, s=2048) at L = 4, 9, 16, 36: no-remat, per-layer save-nothing, nested sqrt(L) with no
  remat inside (Chen's scheme) and with save-nothing inside: the same figures, the compiled peak
  less the arguments, and the textbook count of stored layer inputs (L vs G + L/G).
- ``bench_<part>.json``: machine, jax version, wall seconds of the part.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from remat_kit.memory.api import analyze_model  # noqa: E402
from remat_kit.models import ModelConfig, get_config, sqrt_groups, stored_layer_inputs  # noqa: E402  # noqa: E402
from remat_kit.training.step import (  # noqa: E402
    abstract_batch,
    abstract_train_state,
    loss_fn,
    make_optimizer,
    make_train_step,
)
from remat_kit.walker import (  # noqa: E402
    activation_bytes,
    saved_residuals,
    traced_flops,  # noqa: E402
)

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "experiments" / "results" / "structure"
TARGET = "h100-sxm"
GIB = 2**30

#: (label, ModelConfig overrides) for the llama3-8b table.
LLAMA_VARIANTS = [
    ("no-remat", dict(remat_policy="no-remat")),
    ("per-layer save-nothing", dict(remat_policy="save-nothing")),
    ("nested 4x8, no remat inside (Chen)", dict(nested_remat=True, remat_policy="no-remat")),
    ("nested 4x8, save-nothing inside", dict(nested_remat=True, remat_policy="save-nothing")),
    ("partial: first 16 of 32 save-nothing", dict(remat_policy="save-nothing", remat_layers=16)),
    (
        "partial: every 2nd of 32 save-nothing",
        dict(remat_policy="save-nothing", remat_layers=16, remat_placement="interleaved"),
    ),
    (
        "per-layer save-nothing + chunked loss (1024)",
        dict(remat_policy="save-nothing", loss_chunk_size=1024),
    ),
    ("no-remat + chunked loss (1024)", dict(remat_policy="no-remat", loss_chunk_size=1024)),
    (
        "nested 4x8 save-nothing + chunked loss (1024)",
        dict(nested_remat=True, remat_policy="save-nothing", loss_chunk_size=1024),
    ),
]


def stored_residual_bytes(config: ModelConfig, batch_size: int, seq_len: int) -> tuple[int, int]:
    """Device bytes the forward pass saves for the backward (jaxpr of the loss's VJP, shapes
    only; parameters and the batch are arguments, not counted), and the part of it stacked by a
    layer scan with per-layer shape [batch, seq, d_model] (layer inputs / outer carries, and for
    no-remat also the other [b, s, h] activations)."""
    state = abstract_train_state(config, make_optimizer("sgd"))
    batch = abstract_batch(batch_size, seq_len)
    res = saved_residuals(lambda p, b: loss_fn(p, config, b), state.params, batch)
    bsh = (batch_size, seq_len, config.d_model)
    stacked = sum(
        r.nbytes
        for r in res
        if not r.is_argument and len(r.shape) == 4 and r.shape[1:] == bsh and r.memory == "device"
    )
    return activation_bytes(res, "device"), stacked


def step_traced_flops(config: ModelConfig, batch_size: int, seq_len: int) -> float:
    """Matmul FLOPs of the training step's jaxpr (JAX's remat recompute included, XLA's own
    rematerialisation not: the structure's cost independent of the compiler)."""
    opt = make_optimizer("adamw")
    step = make_train_step(config, opt, jit=False)
    return traced_flops(
        step, abstract_train_state(config, opt), abstract_batch(batch_size, seq_len)
    )


def measure(config: ModelConfig, batch_size: int, seq_len: int) -> dict:
    t0 = time.perf_counter()
    stored = stored_residual_bytes(config, batch_size, seq_len)
    report = analyze_model(config, batch_size, seq_len, target=TARGET, compare_offload=False)
    row = {
        "peak_bytes": report.peak_bytes,
        "temp_bytes": report.temp_bytes,
        "argument_bytes": report.argument_bytes,
        "stored_residual_bytes": stored[0],
        "stored_stacked_bsh_bytes": stored[1],
        "flops": report.flops,
        "flops_traced": step_traced_flops(config, batch_size, seq_len),
        "logits_live_at_peak_bytes": report.logits.live_at_peak_bytes if report.logits else None,
        "compile_s": round(report.compile_s, 1) if report.compile_s is not None else None,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    return row


def _show(label: str, row: dict, unit: int, name: str) -> None:
    peak, stored = row["peak_bytes"] / unit, row["stored_residual_bytes"] / unit
    stacked = row["stored_stacked_bsh_bytes"] / unit
    logits = (row["logits_live_at_peak_bytes"] or 0) / unit
    print(
        f"{label:52s} peak {peak:9.2f} {name}  stored {stored:9.2f} (stacked [b,s,h] "
        f"{stacked:8.2f})  logits@peak {logits:.2f}  flops x{row['flops_ratio']} "
        f"(traced x{row['flops_ratio_traced']})",
        flush=True,
    )


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


#: The same with cuDNN flash attention (no [b, heads, s, s] scores): where the issue's step fits.
LLAMA_CUDNN_VARIANTS = [
    ("cudnn per-layer save-nothing", dict(remat_policy="save-nothing")),
    (
        "cudnn per-layer save-nothing + chunked loss (1024)",
        dict(remat_policy="save-nothing", loss_chunk_size=1024),
    ),
    ("cudnn nested 4x8, save-nothing inside", dict(nested_remat=True, remat_policy="save-nothing")),
    (
        "cudnn partial: first 28 of 32 save-nothing",
        dict(remat_policy="save-nothing", remat_layers=28),
    ),
    (
        "cudnn partial: first 24 of 32 save-nothing",
        dict(remat_policy="save-nothing", remat_layers=24),
    ),
    (
        "cudnn partial: first 24 of 32 + chunked loss",
        dict(remat_policy="save-nothing", remat_layers=24, loss_chunk_size=1024),
    ),
]


def _llama_base(num_layers: int, attention: str) -> ModelConfig:
    base = get_config("llama3-8b", attention=attention)
    return base if num_layers == base.num_layers else base.replace(num_layers=num_layers)


def _ratios(row: dict, baseline: float) -> None:
    """FLOPs over the traced no-remat step's (same attention): compiled (``flops_ratio``, XLA's
    own rematerialisation included, as ``MemoryReport.recompute_ratio``) and traced."""
    row["flops_no_remat_traced"] = baseline
    row["flops_ratio"] = round(row["flops"] / baseline, 4) if row.get("flops") else None
    row["flops_ratio_traced"] = round(row["flops_traced"] / baseline, 4)


def llama_part(num_layers: int, variants, attention: str, out: Path) -> list[dict]:
    base = _llama_base(num_layers, attention)
    baseline = step_traced_flops(base.replace(remat_policy="no-remat"), 1, 8192)
    rows = []
    for label, overrides in variants:
        config = base.replace(**overrides)
        row = {"variant": label, "model": "llama3-8b", "num_layers": num_layers, "batch": 1,
               "seq": 8192, "target": TARGET, "attention": attention,
               "outer_groups": config.outer_groups, **overrides}  # fmt: skip
        row.update(measure(config, 1, 8192))
        _ratios(row, baseline)
        _show(label, row, GIB, "GiB")
        rows.append(row)
        _write(out, rows)
    return rows


def add_traced(path: Path) -> None:
    """Fill in the traced FLOPs ratios of rows measured before they were recorded (tracing
    only, nothing compiled)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    base = _llama_base(rows[0]["num_layers"], rows[0].get("attention", "xla"))
    baseline = step_traced_flops(base.replace(remat_policy="no-remat"), 1, 8192)
    keys = {f.name for f in dataclasses.fields(ModelConfig)}
    for row in rows:
        config = base.replace(**{k: v for k, v in row.items() if k in keys})
        row.setdefault("attention", base.attention)
        row["flops_traced"] = step_traced_flops(config, 1, 8192)
        _ratios(row, baseline)
    _write(path, rows)


def chen_config(num_layers: int, **overrides) -> ModelConfig:
    return ModelConfig(
        name=f"chen-L{num_layers}", vocab_size=256, d_model=256, num_layers=num_layers,
        num_heads=4, d_ff=1024, max_seq_len=2048, norm="rmsnorm", mlp="swiglu", positions="rope",
        tied_embeddings=False, dtype="bfloat16", param_dtype="bfloat16", attention="cudnn",
        **overrides,
    )  # fmt: skip


CHEN_VARIANTS = [
    ("no-remat", dict(remat_policy="no-remat")),
    ("per-layer save-nothing", dict(remat_policy="save-nothing")),
    ("nested sqrt(L), no remat inside", dict(nested_remat=True, remat_policy="no-remat")),
    ("nested sqrt(L), save-nothing inside", dict(nested_remat=True, remat_policy="save-nothing")),
]


def chen_part(layer_counts: list[int], batch: int, seq: int, out: Path) -> list[dict]:
    rows = []
    for num_layers in layer_counts:
        baseline = None
        for label, overrides in CHEN_VARIANTS:
            config = chen_config(num_layers, **overrides)
            groups = config.outer_groups
            row = {"variant": label, "num_layers": num_layers, "outer_groups": groups,
                   "batch": batch, "seq": seq, "d_model": 256, "target": TARGET,
                   "textbook_layer_inputs": stored_layer_inputs(num_layers, groups)}  # fmt: skip
            row.update(measure(config, batch, seq))
            row["peak_less_arguments_bytes"] = row["peak_bytes"] - row["argument_bytes"]
            if baseline is None:
                baseline = step_traced_flops(config.replace(remat_policy="no-remat"), batch, seq)
            _ratios(row, baseline)
            _show(f"L={num_layers:2d} {label}", row, 2**20, "MiB")
            rows.append(row)
            _write(out / "chen.jsonl", rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", choices=["llama", "llama-cudnn", "traced", "chen", "all"], default="all"
    )
    parser.add_argument("--layers", type=int, default=32, help="llama3-8b layer count")
    parser.add_argument("--chen-layers", default="4,9,16,36")
    parser.add_argument("--chen-batch", type=int, default=8)
    parser.add_argument("--chen-seq", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    info = {
        "machine": {"cpus": os.cpu_count(), "processor": platform.machine(),
                    "jax": jax.__version__, "target": f"{TARGET} (deviceless, jax-cuda12-plugin)"},
        "nested_groups_32": sqrt_groups(32),
    }  # fmt: skip
    if args.part in ("llama", "all"):
        t0 = time.perf_counter()
        llama_part(args.layers, LLAMA_VARIANTS, "xla", out / "llama3-8b.jsonl")
        info["llama_wall_s"] = round(time.perf_counter() - t0, 1)
    if args.part == "traced":
        add_traced(out / "llama3-8b.jsonl")
    if args.part in ("llama-cudnn", "all"):
        t0 = time.perf_counter()
        llama_part(args.layers, LLAMA_CUDNN_VARIANTS, "cudnn", out / "llama3-8b-cudnn.jsonl")
        info["llama_cudnn_wall_s"] = round(time.perf_counter() - t0, 1)
    if args.part in ("chen", "all"):
        t0 = time.perf_counter()
        layers = [int(x) for x in args.chen_layers.split(",")]
        chen_part(layers, args.chen_batch, args.chen_seq, out)
        info["chen_wall_s"] = round(time.perf_counter() - t0, 1)
    (out / f"bench_{args.part}.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main()
