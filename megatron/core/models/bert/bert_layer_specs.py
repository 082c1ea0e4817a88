"""Layer spec for BERT's encoder: the local (torch) transformer layer with a padding attention mask."""
from megatron.core.models.gpt.gpt_layer_specs import get_local_layer_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import lazy_names

# Megatron's spec object and Transformer Engine spec names (the local spec here), resolved on first use.
__getattr__ = lazy_names(__name__, {name: "megatron.core._compat.bert_layer_specs" for name in (
    "bert_layer_local_spec", "get_bert_layer_with_transformer_engine_submodules",
    "get_bert_layer_with_transformer_engine_spec")})


def get_bert_layer_local_spec() -> ModuleSpec:
    """Pre-norm encoder layer; every token attends to every real (non-pad) token."""
    return get_local_layer_spec(AttnMaskType.padding)
