"""Flax transformer modules with checkpoint-name tags, and their configs."""

from remat_kit.models.config import PRESETS as PRESETS
from remat_kit.models.config import ModelConfig as ModelConfig
from remat_kit.models.config import get_config as get_config
from remat_kit.models.config import preset_names as preset_names
from remat_kit.models.transformer import Attention as Attention
from remat_kit.models.transformer import Block as Block
from remat_kit.models.transformer import BlockGroup as BlockGroup
from remat_kit.models.transformer import Mlp as Mlp
from remat_kit.models.transformer import Transformer as Transformer
from remat_kit.models.transformer import make_model as make_model
