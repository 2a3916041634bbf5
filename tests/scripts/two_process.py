"""One process of a 2-process data-parallel run on the CPU (gloo collectives), or the same
3 steps in one process (argument "single"). Prints JSON {"devices": N, "losses": [...]}.
Used by tests/test_sharding.py: python two_process.py PROCESS_ID PORT | single."""

import json
import sys

import jax

single = sys.argv[1] == "single"
if not single:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{sys.argv[2]}", num_processes=2, process_id=int(sys.argv[1])
    )

import numpy as np  # noqa: E402

import remat_kit  # noqa: E402
from remat_kit import sharding as S  # noqa: E402
from remat_kit.train import init_train_state, make_optimizer, make_train_step  # noqa: E402

config = remat_kit.get_config("tiny-gpt", remat_policy="save-dots-no-batch")
optimizer = make_optimizer("adamw")
rng = np.random.default_rng(0)
full = {k: rng.integers(0, 256, (4, 32)).astype(np.int32) for k in ("inputs", "targets")}
step_fn = make_train_step(config, optimizer, jit=False)

if single:
    state = init_train_state(config, optimizer, jax.random.key(0))
    step, batch = jax.jit(step_fn), full
else:
    pid = jax.process_index()
    mesh = S.make_mesh(S.parse_mesh("dp=2", 2), jax.devices())
    _, shardings = S.sharded_train_state(config, optimizer, mesh)
    state = jax.jit(
        lambda: init_train_state(config, optimizer, jax.random.key(0)), out_shardings=shardings
    )()
    bs = S.batch_sharding(mesh)
    # Each process feeds its own half of the batch.
    batch = {k: jax.make_array_from_process_local_data(bs, v[pid * 2 : pid * 2 + 2])
             for k, v in full.items()}  # fmt: skip
    step = jax.jit(step_fn, in_shardings=(shardings, bs), out_shardings=(shardings, None))
losses = []
for _ in range(3):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
print(json.dumps({"devices": jax.device_count(), "losses": losses}))
