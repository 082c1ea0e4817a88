"""Megatron Core's transformer names used the way Megatron uses them, one process on CPU: the spec
helpers, the parameters without a feature here refused with one line at any non-default value, the
query/key L2 norm, MoETransformerLayer, and a subclass of the abstract Attention."""
import functools

import pytest
import torch

from tests.fixtures.tiny_gpt import tiny_config


def _config(**kw):
    return tiny_config(use_cpu_initialization=True, **kw)


def test_spec_helpers():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_mlp_module_spec
    from megatron.core.optimizer.distrib_optimizer import Range
    from megatron.core.pipeline_parallel.p2p_communication import is_single_shape
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec, get_submodules
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer, TransformerLayer
    assert get_mlp_module_spec().module is MLP  # use_te=True (Megatron's default) gives the local MLP
    assert get_submodules(ModuleSpec(module=MLP, submodules="s")) == "s"
    assert get_submodules(functools.partial(MLP, submodules="p")) == "p"
    with pytest.raises(ValueError):
        get_submodules(functools.partial(MLP))
    r = Range(10, 14)
    assert (len(r), r.normalize().start, r.normalize(2).end) == (4, 0, 6)
    assert is_single_shape(torch.Size([2, 3])) and is_single_shape((16, 2, 32)) and not is_single_shape([(1, 2)])
    assert TransformerBlockSubmodules().layer_specs is None
    assert issubclass(TransformerLayer, BaseTransformerLayer)
    with pytest.raises(NotImplementedError, match="kitchen"):
        get_gpt_layer_local_spec(use_kitchen_attention=True)
    with pytest.raises(NotImplementedError, match="use_te_op_fuser"):
        get_mlp_module_spec(use_te_op_fuser=True)


def test_modules_refuse_features_they_lack():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import build_module
    config = _config()
    spec = get_gpt_layer_local_spec()
    layer = build_module(spec, config=config, layer_number=1, name="decoder.layers.0")
    assert layer.name == "decoder.layers.0"
    mtp_layer = build_module(spec, config=config, layer_number=1, is_mtp_layer=True)
    assert mtp_layer.is_mtp_layer and mtp_layer.layer_number == 1
    with pytest.raises(NotImplementedError, match="pp_layer_offset"):
        build_module(spec, config=config, layer_number=1, pp_layer_offset=2)
    with pytest.raises(NotImplementedError, match="pp_layer_offset"):
        build_module(spec.submodules.self_attention, config=config, layer_number=1, pp_layer_offset=2)
    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear, activation_func=torch.nn.GELU)
    with pytest.raises(NotImplementedError, match="activation_func"):
        MLP(config, subs)
    attn = DotProductAttention(config, 1, AttnMaskType.causal_bottom_right)
    q = torch.zeros(4, 1, 4, 8)
    with pytest.raises(NotImplementedError, match="causal_bottom_right"):
        attn(q, q, q)


def test_qk_l2_norm_spec_normalizes_queries_and_keys():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.torch_norm import L2Norm
    config = tiny_config(num_layers=1, hidden_size=16, num_attention_heads=2, qk_l2_norm=True)
    layer = build_module(get_gpt_layer_local_spec(qk_l2_norm=True), config=config, layer_number=1)
    norm = layer.self_attention.q_layernorm
    assert isinstance(norm, L2Norm) and isinstance(layer.self_attention.k_layernorm, L2Norm)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), x / x.pow(2).mean(-1, keepdim=True).add(norm.eps).sqrt())
    assert not list(norm.parameters())  # no learned scale
    with pytest.raises(ValueError, match="multi-latent"):
        get_gpt_layer_local_spec(qk_l2_norm=True, multi_latent_attention=True)


def test_moe_transformer_layer_is_a_transformer_layer():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer
    config = tiny_config(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=2,
                         moe_router_topk=1, add_bias_linear=False)
    spec = get_gpt_layer_local_spec(num_experts=2)
    layer = MoETransformerLayer(config, spec.submodules, layer_number=1)
    assert isinstance(layer, TransformerLayer) and layer.is_moe_layer
    out, _ = layer(torch.randn(4, 2, 16), attention_mask=None)
    assert out.shape == (4, 2, 16)
    assert isinstance(ModuleSpec(module=MoETransformerLayer, submodules=spec.submodules), ModuleSpec)


def test_attention_base_runs_a_subclass_like_self_attention():
    """A subclass of Megatron's abstract Attention with three separate q/k/v projections, given the
    slices of a SelfAttention's fused QKV weight, computes the same output (fp32 rounding)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.attention import Attention, SelfAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SeparateQKV(Attention):
        def __init__(self, config, submodules, layer_number):
            super().__init__(config, submodules, layer_number, AttnMaskType.causal, "self")
            kw = dict(config=config, init_method=config.init_method, gather_output=False, bias=False)
            self.q, self.k, self.v = (ColumnParallelLinear(config.hidden_size, self.query_projection_size, **kw)
                                      for _ in range(3))
            self._build_core_and_proj()

        def get_query_key_value_tensors(self, hidden_states, key_value_states=None):
            s, b = hidden_states.shape[:2]
            return tuple(proj(hidden_states)[0].view(s, b, self.np, self.hn) for proj in (self.q, self.k, self.v))

    torch.manual_seed(1)
    config = tiny_config(num_layers=1, hidden_size=16, num_attention_heads=2, add_bias_linear=False)
    submodules = get_gpt_layer_local_spec().submodules.self_attention.submodules
    fused = SelfAttention(config, submodules, 1, AttnMaskType.causal)
    separate = SeparateQKV(config, submodules, 1)
    w = fused.linear_qkv.weight.detach().view(2, 3, 8, 16)  # [group, (q, k, v), hn, h]
    with torch.no_grad():
        for i, proj in enumerate((separate.q, separate.k, separate.v)):
            proj.weight.copy_(w[:, i].reshape(16, 16))
        separate.linear_proj.weight.copy_(fused.linear_proj.weight)
    x = torch.randn(5, 2, 16)
    torch.testing.assert_close(separate(x)[0], fused(x)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError):
        Attention(config, submodules, 1, AttnMaskType.causal, "self")  # abstract
