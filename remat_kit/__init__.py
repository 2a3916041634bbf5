"""remat-kit: choose, measure and verify rematerialization policies for JAX/Flax transformers."""

# targets first: it sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK before JAX discovers its plugins, so the
# CUDA plugin loads quietly on a machine without a GPU (deviceless GPU targets).
from remat_kit import targets as targets  # isort: skip

from remat_kit.doctor import Finding as Finding
from remat_kit.doctor import check as check
from remat_kit.doctor import check_function as check_function
from remat_kit.inject import inject_policy as inject_policy
from remat_kit.loading import load_program as load_program
from remat_kit.memory import CompileError as CompileError
from remat_kit.memory import MemoryReport as MemoryReport
from remat_kit.memory import analyze as analyze
from remat_kit.memory import analyze_model as analyze_model
from remat_kit.memory import analyze_policies as analyze_policies
from remat_kit.memory import program_tags as program_tags
from remat_kit.models import PRESETS as PRESETS
from remat_kit.models import Block as Block
from remat_kit.models import BlockGroup as BlockGroup
from remat_kit.models import ModelConfig as ModelConfig
from remat_kit.models import RematLayerStack as RematLayerStack
from remat_kit.models import Transformer as Transformer
from remat_kit.models import attention_choices as attention_choices
from remat_kit.models import chunked_cross_entropy as chunked_cross_entropy
from remat_kit.models import get_config as get_config
from remat_kit.models import make_model as make_model
from remat_kit.models import preset_names as preset_names
from remat_kit.names import CHECKPOINT_NAMES as CHECKPOINT_NAMES
from remat_kit.placement import sharded as sharded
from remat_kit.policies import PolicyEffect as PolicyEffect
from remat_kit.policies import PolicySpec as PolicySpec
from remat_kit.policies import custom_policy as custom_policy
from remat_kit.policies import custom_spec as custom_spec
from remat_kit.policies import describe as describe
from remat_kit.policies import get_policy_spec as get_policy_spec
from remat_kit.policies import policy as policy
from remat_kit.policies import policy_effect as policy_effect
from remat_kit.policies import policy_names as policy_names
from remat_kit.policies import policy_specs as policy_specs
from remat_kit.policies import remat_implementation as remat_implementation
from remat_kit.program import Program as Program
from remat_kit.recommend import Recommendation as Recommendation
from remat_kit.recommend import recommend as recommend
from remat_kit.tagging import tag_eqx as tag_eqx
from remat_kit.tagging import tag_linen as tag_linen
from remat_kit.tagging import tag_nnx as tag_nnx
from remat_kit.targets import get_target as get_target
from remat_kit.targets import target_names as target_names
from remat_kit.training import TrainState as TrainState
from remat_kit.training import abstract_batch as abstract_batch
from remat_kit.training import abstract_train_state as abstract_train_state
from remat_kit.training import init_train_state as init_train_state
from remat_kit.training import make_optimizer as make_optimizer
from remat_kit.training import make_train_step as make_train_step
from remat_kit.validation import MissingExtraError as MissingExtraError
from remat_kit.zoo import preset as preset
from remat_kit.zoo.textbook import korthikanti_bytes as korthikanti_bytes
from remat_kit.zoo.textbook import per_layer_activations as per_layer_activations

__version__ = "0.1.0"

__all__ = [
    "Block",
    "BlockGroup",
    "CHECKPOINT_NAMES",
    "CompileError",
    "Finding",
    "MemoryReport",
    "MissingExtraError",
    "ModelConfig",
    "PRESETS",
    "PolicyEffect",
    "PolicySpec",
    "Program",
    "Recommendation",
    "RematLayerStack",
    "TrainState",
    "Transformer",
    "abstract_batch",
    "abstract_train_state",
    "analyze",
    "analyze_model",
    "analyze_policies",
    "attention_choices",
    "check",
    "check_function",
    "chunked_cross_entropy",
    "custom_policy",
    "custom_spec",
    "describe",
    "get_config",
    "get_policy_spec",
    "get_target",
    "init_train_state",
    "inject_policy",
    "korthikanti_bytes",
    "load_program",
    "make_model",
    "make_optimizer",
    "make_train_step",
    "per_layer_activations",
    "policy",
    "policy_effect",
    "policy_names",
    "policy_specs",
    "preset",
    "preset_names",
    "program_tags",
    "recommend",
    "remat_implementation",
    "sharded",
    "tag_eqx",
    "tag_linen",
    "tag_nnx",
    "target_names",
]
