"""Megatron Core's BERT spec names that nothing here calls: the module-level local spec object and the
Transformer Engine getters, which return the local spec without TE. Reached from
``megatron.core.models.bert.bert_layer_specs`` through its lazy alias table.
"""
from megatron.core.models.bert.bert_layer_specs import get_bert_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

# Megatron Core exposes the spec as a module-level object as well.
bert_layer_local_spec = get_bert_layer_local_spec()


def get_bert_layer_with_transformer_engine_submodules():
    """Without Transformer Engine: the submodules of our fastest BERT layer, the local one."""
    return get_bert_layer_local_spec().submodules


def get_bert_layer_with_transformer_engine_spec() -> ModuleSpec:
    """Our fastest BERT layer spec (the local spec: no Transformer Engine here), under Megatron's TE name."""
    return get_bert_layer_local_spec()
