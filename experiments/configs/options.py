"""Option grid: the effect of each layer-structure / loss / attention option against the plain
step, one option varied at a time (issue 17).

Command::

    python experiments/sweep.py --config options --out experiments/results/options/sweep.jsonl

Committed run (``experiments/results/options/``: rows, ``summary.md`` with an options table,
``options.png``): 25 points in 7 min 36 s of wall time (3 min 37 s user CPU) on a 2-core x86_64
CPU shared with other jobs (load average 6-11), XLA:CPU, jax 0.10.2, with ``--overwrite``.
About two thirds of it is compiling; on an idle machine expect ~4-5 minutes.

(a) ``measured:*``: ``gpt-10m`` (byte-level, 11.1M parameters, 6 layers, d_model 384), scanned
    layers, batch 4, s=256, analysed on the CPU backend then 1 warm-up and 3 timed AdamW steps
    on the Python standard library's source. Grids: ``plain`` (no-remat, save-nothing);
    ``remat_layers=0/2/4/6`` (the first k of 6 layers under save-nothing, the rest no remat);
    ``nested`` (two-level scan over 2 groups of 3 layers; no-remat inside (Chen et al. 2016,
    arXiv:1604.06174) and save-nothing inside); ``loss_chunk_size=64`` (chunked cross-entropy;
    no-remat and save-nothing). ``attention`` is ``xla`` throughout: cuDNN does not exist on
    the CPU. The CPU backend reports no peak memory: ``measured_peak_bytes`` is null.
(b) ``h100:*``: ``llama3.2-1b`` cut to 4 layers (``num_layers`` override; d_model 2048, 32
    heads, vocab 128256, bf16 parameters and AdamW state), b=1, s=8192, on ``h100-sxm``
    compiled deviceless (analysis only: peak and FLOPs, no step time). The same grids with k in
    0..4, 2 outer groups and chunks of 1024 tokens, plus ``attention=cudnn`` and cuDNN with
    the chunked loss (no-remat, save-nothing). Needs the CUDA plugin (``pip install
    'remat-kit[cuda12]'``); left out without it.

Each grid's name is stored in its rows with the overrides, so points differing only in an
option are distinct rows (keys). ``options.png`` draws every variant: predicted peak, the
policy's matmul FLOPs over the plain no-remat step with XLA attention, measured step time
where there is one (:func:`remat_kit.plots.option_effects`).

Expected (the committed run; peak change against the plain no-remat step):

* partial remat: FLOPs grow linearly in k (gpt-10m +0.077 per 2 layers; llama +0.040 per
  layer); the peak falls roughly linearly in k (gpt-10m 609 -> 480 -> 351 -> 251 MiB: -129,
  -129, -100 per 2 layers; llama 89.9 -> 66.8 -> 47.5 -> 24.0 GiB: -19 to -23 per layer) until
  another buffer sets it (llama k=3 and k=4 both ~24 GiB). k=0 gives no-remat's figures, k=L
  per-layer save-nothing's. llama's no-remat peak includes XLA's own rematerialisation (it
  does not fit the H100: compiled FLOPs 1.026x, the policy's own 1.000x shown).
* nested: the forward stores 2 outer carries instead of 6 / 4 layer inputs (3 vs 9 MiB; 64
  vs 128 MiB); nested with no-remat inside cuts the peak by 25% / 48% for 1.33x / 1.20x
  FLOPs; with save-nothing inside it peaks above per-layer save-nothing (290 vs 251 MiB;
  24.8 vs 24.4 GiB) for more FLOPs (1.56x / 1.36x vs 1.23x / 1.16x).
* chunked loss: no peak change at vocabulary 256 (gpt-10m); with XLA attention on llama
  -1.5 / -0.3 GiB (the [s, s] attention scores set the peak) for +0.14 FLOPs (the LM head is
  recomputed, a large share of a 4-layer model's FLOPs); with cuDNN attention, where the
  logits are at the peak, -31% / -47% (13.8 -> 9.5 GiB, 8.9 -> 4.7 GiB).
* cuDNN attention: peak 89.9 -> 13.8 GiB (no-remat) and 24.4 -> 8.9 GiB (save-nothing);
  FLOPs 0.91x (our count of its matmul work halves the causal scores; XLA attention computes
  the full [s, s]).
* measured step time on this CPU: wall time is at the mercy of the other jobs (1.8-2.7 s a
  step, no order); process CPU time per step is within 1.23-1.32 s for every variant but the
  nested ones (1.48 / 1.58 s): the CPU step is not matmul-bound (as in the ``cpu`` config).
"""

from remat_kit import targets
from remat_kit.sweep import Grid, SweepConfig

_MEASURED = dict(
    models=("gpt-10m",), batch_sizes=(4,), seq_lens=(256,), targets=("local",),
    warmup_steps=1, timed_steps=3, measure=True,
)  # fmt: skip
_H100 = dict(
    models=("llama3.2-1b",), batch_sizes=(1,), seq_lens=(8192,), targets=("h100-sxm",),
    measure=False,
)  # fmt: skip
_BOTH = ("no-remat", "save-nothing")


def _option_grids(prefix: str, base: dict, shape: dict, ks: tuple, chunk: int) -> list[Grid]:
    """The plain step and one grid per option value (``prefix:option=value``)."""
    variants = [("plain", {}, _BOTH)]
    variants += [(f"remat_layers={k}", {"remat_layers": k}, ("save-nothing",)) for k in ks]
    variants.append(("nested", {"nested_remat": True, "nested_groups": 2}, _BOTH))
    variants.append((f"loss_chunk_size={chunk}", {"loss_chunk_size": chunk}, _BOTH))
    return [
        Grid(name=f"{prefix}:{name}", policies=policies, overrides={**base, **extra}, **shape)
        for name, extra, policies in variants
    ]


def get_config() -> SweepConfig:
    grids = _option_grids("measured", {"scan_layers": True}, _MEASURED, (0, 2, 4, 6), chunk=64)
    if targets.cuda_plugin_module() is not None:
        base = {"scan_layers": True, "num_layers": 4}
        grids += _option_grids("h100", base, _H100, (0, 1, 2, 3, 4), chunk=1024)
        cudnn = {**base, "attention": "cudnn"}
        grids += [
            Grid(name="h100:attention=cudnn", policies=_BOTH, overrides=cudnn, **_H100),
            # where the logits are at the peak (cuDNN attention), the chunked loss beside it
            Grid(name="h100:attention=cudnn,loss_chunk_size=1024", policies=_BOTH,
                 overrides={**cudnn, "loss_chunk_size": 1024}, **_H100),
        ]  # fmt: skip
    return SweepConfig(
        name="options",
        description="each option (remat_layers, nested_remat, loss_chunk_size, attention) vs "
        "the plain step: gpt-10m measured on the local device, llama3.2-1b (4 layers, s=8192) "
        "analysed for h100-sxm",
        grids=tuple(grids),
    )
