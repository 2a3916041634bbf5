"""Small example models written against jax/flax/optax only, importable for the docs' examples.

- :mod:`remat_kit.examples.plain_jax`: a plain-JAX scanned transformer that tags its own tensors
  (``attn_in``, ``attn_out``, ``mlp_hidden``): ``make_loss(policy)``, ``init(key)``,
  ``tokens(batch, seq)``, ``program()``.
"""
