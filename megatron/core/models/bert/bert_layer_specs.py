"""Layer spec for BERT's encoder: the local (torch) transformer layer with a padding attention mask."""
from megatron.core.models.gpt.gpt_layer_specs import get_local_layer_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec


def get_bert_layer_local_spec() -> ModuleSpec:
    """Pre-norm encoder layer; every token attends to every real (non-pad) token."""
    return get_local_layer_spec(AttnMaskType.padding)


# Megatron Core exposes the spec as a module-level object as well.
bert_layer_local_spec = get_bert_layer_local_spec()


def get_bert_layer_with_transformer_engine_submodules():
    """Without Transformer Engine: the submodules of our fastest BERT layer, the local one."""
    return get_bert_layer_local_spec().submodules


def get_bert_layer_with_transformer_engine_spec() -> ModuleSpec:
    """Our fastest BERT layer spec (the local spec: no Transformer Engine here), under Megatron's TE name."""
    return get_bert_layer_local_spec()
