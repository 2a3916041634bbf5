"""remat-kit: choose, measure and verify rematerialization policies for JAX/Flax transformers."""

# targets first: it sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK before JAX discovers its plugins, so the
# CUDA plugin loads quietly on a machine without a GPU (deviceless GPU targets).
from remat_kit import targets as targets  # isort: skip

from remat_kit.models import (
    PRESETS,
    Block,
    BlockGroup,
    ModelConfig,
    Transformer,
    get_config,
    make_model,
    preset_names,
)
from remat_kit.names import CHECKPOINT_NAMES
from remat_kit.policies import (
    PolicySpec,
    custom_policy,
    custom_spec,
    describe,
    get_policy_spec,
    policy,
    policy_names,
    policy_specs,
)
from remat_kit.train import (
    TrainState,
    abstract_batch,
    abstract_train_state,
    init_train_state,
    make_optimizer,
    make_train_step,
)

__version__ = "0.1.0"

__all__ = sorted(
    [
        "Block",
        "BlockGroup",
        "CHECKPOINT_NAMES",
        "ModelConfig",
        "PRESETS",
        "PolicySpec",
        "TrainState",
        "Transformer",
        "abstract_batch",
        "abstract_train_state",
        "custom_policy",
        "custom_spec",
        "describe",
        "get_config",
        "get_policy_spec",
        "init_train_state",
        "make_model",
        "make_optimizer",
        "make_train_step",
        "policy",
        "policy_names",
        "policy_specs",
        "preset_names",
    ]
)
