"""The plain-JAX example model lives in :mod:`remat_kit.examples.plain_jax` (importable by users
and the docs); re-exported here so ``--model tests/user_models/plain_jax.py:program`` and the
tests' imports keep working."""

from remat_kit.examples.plain_jax import (  # noqa: F401
    TAGS,
    D,
    F,
    H,
    L,
    V,
    abstract_args,
    init,
    layer,
    loop_loss,
    make_loss,
    make_step,
    program,
    tokens,
)
