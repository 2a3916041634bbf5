"""The plain-JAX example model lives in :mod:`remat_kit.examples.plain_jax` (importable by users
and the docs); re-exported here so the tests' imports and
``--model tests/user_models/plain_jax.py:program`` keep working."""

from remat_kit.examples import plain_jax as _example
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
    tokens,
)


def program():
    """The program the command line loads: ``--model tests/user_models/plain_jax.py:program``
    (a factory defined here, so ``load_program`` lists it for this file)."""
    return _example.program()
