"""TPU slices, analysis only, compiled on a CPU machine through libtpu: llama3-8b on a v5p-8
slice (4 chips, fsdp=4) and llama3-70b on a v6e-256 slice (fsdp=256), every policy.

Command::

    pip install 'remat-kit[tpu]'          # libtpu: XLA's TPU compiler
    python experiments/sweep.py --config tpu --out experiments/results/tpu

Nothing runs on a TPU: each point lowers the training step on a mesh over the slice's
deviceless devices (:func:`~remat_kit.targets.topology`) and compiles it with XLA's TPU
compiler; figures are per device (= per chip; v5p chips run their two TensorCores as one JAX
device). A point whose step does not fit the chip's HBM fails to compile on TPU (XLA: "Ran out
of memory on HBM") and is recorded as such. Host offload is real on TPU: offloading policies
show host bytes.

Shapes: llama3-8b, batch 4 (one sequence per chip), s=8192; llama3-70b, batch 256 (one per
chip), s=8192; bf16 parameters, AdamW state, scanned layers.

Runtime and results: see docs/tpu.md (the table there names the machine, jax and libtpu
versions and the wall time of each command).
"""

from remat_kit.sweep import ALL_POLICIES, Grid, SweepConfig


def get_config() -> SweepConfig:
    return SweepConfig(
        name="tpu",
        description="llama3-8b on v5p-8 (fsdp=4) and llama3-70b on v6e-256 (fsdp=256), every "
        "policy, s=8192, analysis only (compiled for TPU on a CPU machine)",
        grids=(
            Grid(
                name="v5p-8",
                models=("llama3-8b",),
                policies=ALL_POLICIES,
                batch_sizes=(4,),
                seq_lens=(8192,),
                targets=("v5p-8",),
                mesh="fsdp=4",
                measure=False,
            ),
            Grid(
                name="v6e-256",
                models=("llama3-70b",),
                policies=ALL_POLICIES,
                batch_sizes=(256,),
                seq_lens=(8192,),
                targets=("v6e-256",),
                mesh="fsdp=256",
                measure=False,
            ),
        ),
    )
