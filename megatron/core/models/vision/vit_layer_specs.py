"""Layer specs of the ViT encoder: the text transformer layer, pre-norm, every patch sees every patch."""
from megatron.core.models.gpt.gpt_layer_specs import get_local_layer_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.te_key_map import TRANSFORMER_ENGINE


def get_vit_layer_with_local_spec() -> ModuleSpec:
    """Pre-norm layer (LayerNorm, attention, LayerNorm, MLP) with a non-causal (no) attention mask."""
    return get_local_layer_spec(AttnMaskType.no_mask)


def get_vit_layer_with_transformer_engine_spec() -> ModuleSpec:
    """The same local layer (no Transformer Engine here) with Megatron's TE-spec checkpoint key names."""
    spec = get_vit_layer_with_local_spec()
    spec.submodules.checkpoint_key_names = TRANSFORMER_ENGINE
    return spec


def get_vision_projection_submodules() -> MLPSubmodules:
    """The projector's linears (column-parallel fc1, row-parallel fc2)."""
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def get_vision_projection_spec() -> ModuleSpec:
    return ModuleSpec(module=MLP, submodules=get_vision_projection_submodules())
