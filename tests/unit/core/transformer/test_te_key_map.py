"""te_key_map.py: the TE spec's state dict carries Megatron's TE-spec key names, and either naming loads
under either spec with equal logits; FP8 ``_extra_state`` is refused naming the tensor."""
import io
import pickle

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import te_key_map
from tests.fixtures.tiny_gpt import VOCAB, tiny_config, tiny_gpt

# Megatron-LM (d98e8a6) megatron/core/models/gpt/gpt_layer_specs.py get_gpt_layer_with_transformer_engine_
# submodules: input_layernorm = IdentityOp, linear_qkv = TELayerNormColumnParallelLinear, core_attention =
# TEDotProductAttention, linear_proj = TERowParallelLinear, pre_mlp_layernorm = IdentityOp (dense),
# linear_fc1 = TELayerNormColumnParallelLinear, linear_fc2 = TERowParallelLinear; parameter names from
# Transformer Engine's LayerNormLinear (weight, bias, layer_norm_weight, layer_norm_bias) and Linear, each TE
# module with an `_extra_state`; final_layernorm = TENorm; embedding and output layer are not TE modules.
TE_DENSE_LAYER = [
    "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
    "self_attention.linear_qkv._extra_state", "self_attention.core_attention._extra_state",
    "self_attention.linear_proj._extra_state", "mlp.linear_fc1._extra_state", "mlp.linear_fc2._extra_state",
]
# The MoE layer of the same spec (moe_module_specs.py with TESpecProvider): pre_mlp_layernorm stays a TENorm,
# the router is not a TE module, TEGroupedMLP's experts are TE GroupedLinear (weight0..weight{E-1}).
TE_GROUPED_MOE_LAYER = [
    "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", "mlp.router.weight",
    "mlp.experts.linear_fc1.weight0", "mlp.experts.linear_fc1.weight1", "mlp.experts.linear_fc2.weight0",
    "mlp.experts.linear_fc2.weight1", "self_attention.linear_qkv._extra_state",
    "self_attention.core_attention._extra_state", "self_attention.linear_proj._extra_state",
    "mlp.experts.linear_fc1._extra_state", "mlp.experts.linear_fc2._extra_state",
]


def _names(model):
    return [k[len("decoder.layers.0."):] for k in model.state_dict() if k.startswith("decoder.layers.0.")]


def _logits(model):
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    return model(tokens, torch.arange(16).expand(2, -1), None)


def test_te_spec_state_dict_has_megatron_te_names():
    model = tiny_gpt(tiny_config(), spec=get_gpt_layer_with_transformer_engine_spec())
    assert _names(model) == TE_DENSE_LAYER
    assert model.state_dict()["decoder.layers.1.mlp.linear_fc2._extra_state"].numel() == 0
    assert {"decoder.final_layernorm.weight", "embedding.word_embeddings.weight"} <= set(model.state_dict())
    assert "decoder.layers.0.input_layernorm.weight" in tiny_gpt().state_dict()  # local names under local


def test_te_spec_grouped_experts_are_numbered_weights():
    config = tiny_config(num_moe_experts=2, moe_grouped_gemm=True, add_bias_linear=False, moe_ffn_hidden_size=16,
                         normalization="RMSNorm")
    model = tiny_gpt(config, spec=get_gpt_decoder_block_spec(config, use_transformer_engine=True))
    assert _names(model) == TE_GROUPED_MOE_LAYER
    sd = model.state_dict()
    stacked = model.decoder.layers[0].mlp.experts.weight1
    assert torch.equal(sd["decoder.layers.0.mlp.experts.linear_fc1.weight1"], stacked[1])
    local = tiny_gpt(config, spec=get_gpt_decoder_block_spec(config))
    local.load_state_dict(sd)
    assert torch.equal(_logits(local), _logits(model))


@pytest.mark.parametrize("save_te,load_te", [(True, False), (False, True)])
def test_state_dict_of_either_spec_loads_under_the_other(save_te, load_te):
    spec = lambda te: get_gpt_layer_with_transformer_engine_spec() if te else get_gpt_layer_local_spec()  # noqa: E731
    src = tiny_gpt(tiny_config(), spec=spec(save_te))
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms away from ones: a wrong mapping shows in the logits
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst = tiny_gpt(tiny_config(), spec=spec(load_te))
    dst.load_state_dict(torch.load(buf, weights_only=False))
    assert torch.equal(_logits(dst), _logits(src))


def test_both_specs_initialize_alike():
    torch.manual_seed(0)
    local = tiny_gpt()
    torch.manual_seed(0)
    te = tiny_gpt(spec=get_gpt_layer_with_transformer_engine_spec())
    assert torch.equal(_logits(local), _logits(te))


def test_sharded_state_dict_uses_te_names():
    model = tiny_gpt(tiny_config(), spec=get_gpt_layer_with_transformer_engine_spec())
    sharded = model.sharded_state_dict()
    key = "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    assert sharded[key].key == key and "decoder.layers.1.pre_mlp_layernorm.weight" not in sharded
    assert te_key_map.alternative_key("optimizer.state.exp_avg." + key) == \
        "optimizer.state.exp_avg.decoder.layers.1.pre_mlp_layernorm.weight"
    assert te_key_map.alternative_key("decoder.layers.0.input_layernorm.bias") == \
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias"


def _pickled(state):
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def test_extra_state_without_fp8_is_accepted():
    model = tiny_gpt(tiny_config(), spec=get_gpt_layer_with_transformer_engine_spec())
    sd = model.state_dict()
    sd["decoder.layers.0.self_attention.linear_qkv._extra_state"] = _pickled(None)  # TE 1.x without FP8
    sd["decoder.final_layernorm._extra_state"] = torch.empty(0, dtype=torch.uint8)  # TENorm of newer TE
    model.load_state_dict(sd)


def test_extra_state_with_fp8_scales_is_refused_naming_the_tensor():
    model = tiny_gpt(tiny_config(), spec=get_gpt_layer_with_transformer_engine_spec())
    sd = model.state_dict()
    key = "decoder.layers.1.mlp.linear_fc1._extra_state"
    sd[key] = _pickled({"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(1, 3), "recipe": None})
    with pytest.raises(ValueError, match=f"^{key}: Transformer Engine FP8 scaling state"):
        model.load_state_dict(sd)
