"""Run 3 training steps of a tiny model on 8 fake CPU devices under several meshes; print JSON
{mesh: [loss, ...]} (mesh "none" = one device, no sharding). Used by tests/test_sharding.py."""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import remat_kit  # noqa: E402
from remat_kit import targets as T  # noqa: E402
from remat_kit.training import (  # noqa: E402
    init_train_state,
    make_optimizer,
    make_train_step,
    sharded_train_state,
)

#: 2 layers: a remat block following a block, the fewest that still pass activations between
#: sharded layers (4 only compiled more of the same).
config = remat_kit.get_config(
    "tiny-llama", remat_policy="save-dots-no-batch", num_kv_heads=4, d_ff=128, num_layers=2
)
optimizer = make_optimizer("adamw")
keys = jax.random.split(jax.random.key(1))
batch = {
    k: jax.random.randint(key, (8, 32), 0, 256)
    for k, key in zip(("inputs", "targets"), keys, strict=True)
}


def losses(mesh_text: str) -> list[float]:
    state = init_train_state(config, optimizer, jax.random.key(0))
    step = make_train_step(config, optimizer, jit=False)
    b, out_shardings, in_shardings = batch, None, None
    if mesh_text != "none":
        mesh = T.make_mesh(T.parse_mesh(mesh_text, 8), jax.devices()[:8])
        _, shardings = sharded_train_state(config, optimizer, mesh)
        state = jax.device_put(state, shardings)
        b = jax.device_put(batch, T.batch_sharding(mesh))
        in_shardings, out_shardings = (shardings, T.batch_sharding(mesh)), (shardings, None)
    fn = jax.jit(step, in_shardings=in_shardings, out_shardings=out_shardings)
    out = []
    for _ in range(3):
        state, metrics = fn(state, b)
        out.append(float(metrics["loss"]))
    return out


print(json.dumps({m: losses(m) for m in sys.argv[1:]}))
