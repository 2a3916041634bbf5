"""What a training step is, for the analyzer and for a user's own loop: loss, optimizer, train
state, the train-step factory (real, abstract or sharded state).

:func:`make_train_step` returns the step the analyzer compiles (``remat-kit analyze``, the sweep)
and that a training loop calls; :func:`abstract_train_state` and :func:`sharded_train_state` give
its state as shapes or placed on a mesh without allocating it; :func:`grad_fn` accumulates
gradients over micro-batches. Module ``step``: loss, optimizer, train state, the step.

The trainer (``train``, ``TrainConfig``, checkpoints and resume, the byte-level text corpus) is
experiment machinery in ``experiments/trainer/`` of a clone; asking this package for one of its
names raises an ``ImportError`` that says so. Accumulation and the trainer: docs/training.md.

Example::

    import jax
    from remat_kit import get_config
    from remat_kit.training import init_train_state, make_optimizer, make_train_step

    config = get_config("tiny-gpt", remat_policy="save-nothing")
    optimizer = make_optimizer("adamw")
    state = init_train_state(config, optimizer, jax.random.key(0))
    step = make_train_step(config, optimizer)   # jitted: (state, batch) -> (state, metrics)
"""

from remat_kit.training.step import OPTIMIZERS as OPTIMIZERS
from remat_kit.training.step import Batch as Batch
from remat_kit.training.step import TrainState as TrainState
from remat_kit.training.step import abstract_batch as abstract_batch
from remat_kit.training.step import abstract_train_state as abstract_train_state
from remat_kit.training.step import check_micro_batches as check_micro_batches
from remat_kit.training.step import cross_entropy_loss as cross_entropy_loss
from remat_kit.training.step import grad_fn as grad_fn
from remat_kit.training.step import init_boxed_params as init_boxed_params
from remat_kit.training.step import init_params as init_params
from remat_kit.training.step import init_train_state as init_train_state
from remat_kit.training.step import loss_fn as loss_fn
from remat_kit.training.step import make_optimizer as make_optimizer
from remat_kit.training.step import make_train_step as make_train_step
from remat_kit.training.step import sharded_train_state as sharded_train_state

__all__ = [
    "Batch",
    "OPTIMIZERS",
    "TrainState",
    "abstract_batch",
    "abstract_train_state",
    "check_micro_batches",
    "cross_entropy_loss",
    "grad_fn",
    "init_boxed_params",
    "init_params",
    "init_train_state",
    "loss_fn",
    "make_optimizer",
    "make_train_step",
    "sharded_train_state",
]

#: Names that moved to the experiments' trainer (``experiments/trainer/``), with the modules.
_MOVED = frozenset({
    "CHECKPOINT_DIR", "NonFiniteLossError", "RESUME_MAY_CHANGE", "TrainConfig", "TrainResult",
    "clear_caches", "compare_updates", "environment_info", "latest_checkpoint_step",
    "load_checkpoint", "train", "train_step_memory",
    "checkpoint", "compiled", "config", "data", "diagnostics", "distributed", "faults", "loop",
})  # fmt: skip


def __getattr__(name: str):
    """Say where a moved name went (PEP 562), instead of a bare "cannot import name"."""
    if name in _MOVED:
        raise ImportError(
            f"remat_kit.training.{name} moved out of the library to the experiments' trainer: "
            f"from a clone of remat-kit, with experiments/ on sys.path, `from trainer import "
            f"{name}` (experiments/trainer/)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
