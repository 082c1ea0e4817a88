"""TransformerConfig defaults and validation messages."""
import math

import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig


def _cfg(**kw):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=8)
    base.update(kw)
    return TransformerConfig(**base)


def test_derived_defaults():
    c = _cfg()
    assert c.ffn_hidden_size == 256 and c.kv_channels == 8 and c.num_query_groups == 8
    w = torch.empty(20000)
    c.output_layer_init_method(w)
    assert abs(w.std().item() - 0.02 / math.sqrt(2 * 4)) < 5e-4


@pytest.mark.parametrize("kw,match", [
    (dict(tensor_model_parallel_size=3), "num_attention_heads"),
    (dict(num_query_groups=3), "num_query_groups"),
    (dict(normalization="BatchNorm"), "normalization"),
    (dict(recompute_granularity="full"), "recompute-method"),
    (dict(fp16=True, bf16=True), "fp16"),
])
def test_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_moe_config_checked():
    assert _cfg(num_moe_experts=4, moe_router_topk=2).num_moe_experts == 4
    with pytest.raises(ValueError, match="--moe-router-topk"):
        _cfg(num_moe_experts=4, moe_router_topk=5)


def test_sequence_parallel_off_at_tp1():
    assert _cfg(sequence_parallel=True).sequence_parallel is False
