"""Quick sweep: the smoke test (one tiny model, three policies, two steps).

Command::

    python experiments/sweep.py --config quick --out /tmp/rk-quick/sweep.jsonl

Runtime: about 25-45 s on 2 CPU cores (jax 0.10.2), nearly all of it compiling; any machine (the
target is the local device). Expected: 3 rows, all ``ok``; ``save-nothing`` has the lowest
predicted peak; the losses of the three policies agree to float tolerance (remat does not change
the maths).
"""

from remat_kit.sweep import Grid, SweepConfig


def get_config() -> SweepConfig:
    return SweepConfig(
        name="quick",
        description="tiny-gpt, 3 policies, b=2, s=64, 1 warm-up + 1 timed step",
        grids=(
            Grid(
                name="measured",
                measure=True,
                models=("tiny-gpt",),
                policies=("no-remat", "save-nothing", "save-dots-no-batch"),
                batch_sizes=(2,),
                seq_lens=(64,),
                overrides={"scan_layers": True},
                warmup_steps=1,
                timed_steps=1,
            ),
        ),
    )
