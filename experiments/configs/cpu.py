"""Default sweep on a machine without a GPU: a 10M-parameter GPT trained on real text with every
policy, and analysis-only rows for published model shapes on a deviceless H100.

Command::

    python experiments/sweep.py                   # picks this config when JAX sees no GPU
    python experiments/sweep.py --config cpu      # the same, explicitly

Runtime: ~4 CPU-minutes (x86-64, jax 0.10.2, CPU backend): the committed run in
``experiments/results/cpu/`` took 3 min 30 s of wall time on 2 otherwise idle cores (the
sweep's own two threads while it timed, 2026-12-04, AMD EPYC VM, compile cache warm), about half
of it compiling (each policy's step is compiled once per sequence length, two at a time, and both
analysed and run). Hardware: any CPU;
part (b) needs the CUDA plugin (``pip install 'remat-kit[cuda12]'``) and is left out without it.

(a) ``measured``: ``gpt-10m`` (byte-level, 11.1M parameters, 6 layers, d_model 384) with
    scanned layers (XLA:CPU honours remat only inside a scan), every registered policy,
    batch 4, s in {128, 256}: analysed on the CPU backend, then 2 warm-up and 15 timed AdamW steps
    (the policies' steps interleaved: step i of every policy before step i+1 of any)
    on the Python standard library's source. The CPU backend reports no peak memory
    (``memory_stats()`` is None) and has no known peak FLOP/s: ``measured_peak_bytes`` and
    ``mfu`` are null.
(b) ``analysis``: ``gpt2-small`` (b=8, s=1024), ``llama3.2-1b`` (b=4, s=2048) and ``llama3-8b``
    (b=1, s=4096), bf16 parameters and AdamW state, on ``h100-sxm`` compiled deviceless:
    no remat, selective recompute (``save-dots-no-batch``) and full per-layer remat.

Expected (the committed run): every policy trains to the same losses (within 1e-6 nats);
predicted peak -43% (s=128) / -59% (s=256) with full remat, -37% / -51% with
``save-dots-no-batch``; compiled matmul FLOPs x1.23 and x1.02-1.03. On this CPU the step is not
matmul-bound: no-remat, whose temp buffer (allocated and faulted in at every step) is 2-4x the
others', costs more process CPU time than full remat (the others -37.1% to -6.5%), and among
remat policies time does not track the FLOPs ratio; the rows carry the roofline's estimate
(``predicted_step_time_s``) beside the measured time (``experiments/bench_time_model.py``).
Wall times on a shared machine are noisy (XLA uses the second core only when it is free); the
rows keep CPU times beside them. On the H100, ``llama3.2-1b`` (b=4, s=2048) and ``llama3-8b``
(b=1, s=4096) do not fit without remat (109 and 244 GiB predicted) and fit with either remat
policy.
"""

from remat_kit import targets
from remat_kit.sweep import ALL_POLICIES, Grid, SweepConfig

_PUBLISHED = (("gpt2-small", 8, 1024), ("llama3.2-1b", 4, 2048), ("llama3-8b", 1, 4096))


def get_config() -> SweepConfig:
    grids = [
        Grid(
            name="measured",
            measure=True,
            models=("gpt-10m",),
            policies=ALL_POLICIES,
            batch_sizes=(4,),
            seq_lens=(128, 256),
            targets=("local",),
            overrides={"scan_layers": True},
            warmup_steps=2,
            timed_steps=15,
        )
    ]
    gpu = targets.cuda_plugin_module() is not None  # deviceless H100 compiles need the plugin
    if gpu:
        for model, b, s in _PUBLISHED:
            grids.append(
                Grid(
                    name=f"analysis-{model}",
                    models=(model,),
                    policies=("no-remat", "save-dots-no-batch", "save-nothing"),
                    batch_sizes=(b,),
                    seq_lens=(s,),
                    targets=("h100-sxm",),
                    overrides={"scan_layers": True},
                    measure=False,
                )
            )
    published = ", ".join(m for m, _, _ in _PUBLISHED)
    return SweepConfig(
        name="cpu",
        description="gpt-10m x every policy x s in {128, 256} measured on the CPU; "
        + (
            f"{published} analysed for h100-sxm"
            if gpu
            else f"{published} on h100-sxm left out: JAX's CUDA plugin is not installed "
            "(pip install 'remat-kit[cuda12]')"
        ),
        grids=tuple(grids),
    )
