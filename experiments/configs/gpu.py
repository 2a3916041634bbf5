"""Default sweep on a GPU machine: llama3.2-1b and gpt2-medium at s in {1024, 4096, 8192}, every
policy, analysed for the local GPU and measured on it.

Command::

    python experiments/sweep.py                   # picks this config when JAX sees a GPU
    python experiments/sweep.py --config gpu

Runtime: not measured yet (no GPU was available when this config was written); expect tens of
minutes on one H100 / H200 (jax 0.10.2 with CUDA 12), most of it compiling (2 compiles x 13
policies x 3 lengths x 2 models, a few seconds each). Results go to
``experiments/results/<device>/`` (``h200`` on an H200).

Each point is measured on one GPU: on a machine with several, the points run side by side,
one GPU each (worker processes, ``CUDA_VISIBLE_DEVICES`` set per worker), so 8 GPUs measure 8
points at a time; ``--mesh tp=N`` runs each point on a group of N GPUs (heads and MLP split;
figures per device).

Shapes: batch 1, bf16 parameters and AdamW state, scanned layers; gpt2-medium's learned position
table is widened to 8192 (``max_seq_len`` override) so the three lengths apply to both models.

Expected: without remat the longest sequences run out of memory (rows with status ``oom``; the
sweep goes on); full per-layer remat (``save-nothing``) cuts activation memory by ~60-85% for
~20-35% more step time; selective recompute (``save-dots-no-batch``) saves less for ~3-15%
(Korthikanti et al. 2022, arXiv:2205.05198). ``measured_peak_bytes`` is
``memory_stats()["peak_bytes_in_use"]``; a point whose peak does not rise above an earlier
point's peak in the same process records null rather than a borrowed number.
"""

import jax

from remat_kit.sweep import ALL_POLICIES, Grid, SweepConfig


def _device_slug() -> str:
    kind = jax.devices()[0].device_kind.lower()
    for name in ("h200", "h100", "a100", "l4"):
        if name in kind:
            return name
    return "gpu"


def get_config() -> SweepConfig:
    return SweepConfig(
        name=_device_slug(),
        description="llama3.2-1b and gpt2-medium x every policy x s in {1024, 4096, 8192} "
        "on the local GPU",
        grids=(
            Grid(
                name="measured",
                measure=True,
                models=("llama3.2-1b", "gpt2-medium"),
                policies=ALL_POLICIES,
                batch_sizes=(1,),
                seq_lens=(1024, 4096, 8192),
                targets=("local",),
                overrides={"scan_layers": True, "max_seq_len": 8192},
                warmup_steps=2,
                timed_steps=5,
            ),
        ),
    )
