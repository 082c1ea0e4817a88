"""Smaller Megatron Core API pieces against plain references (single process): Megatron's fused
cross-entropy building blocks, the weights_only allow-list, the query/key L2 norm, MoETransformerLayer,
and SamplingParams' token-count and termination fields in the generation engine."""
import argparse
import io

import pytest
import torch
import torch.nn.functional as F

from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt


def test_fused_cross_entropy_blocks_assemble_vocab_parallel_loss():
    """Two vocab halves (TP=2 written out: the all-reduces are a max and a sum over the halves) give
    F.cross_entropy's loss (fp32, 1e-6) and its gradient (returned in bf16: 1e-2)."""
    from megatron.core.fusions import fused_cross_entropy as fce
    torch.manual_seed(0)
    logits, target = torch.randn(5, 3, 11), torch.randint(0, 11, (5, 3))
    ranges = [(0, 6), (6, 11)]
    shards = [fce.calculate_logits_max(logits[..., a:b].clone()) for a, b in ranges]
    logits_max = torch.maximum(shards[0][1], shards[1][1])
    parts = [fce.calculate_predicted_logits(z, target, logits_max, a, b) for (z, _), (a, b) in zip(shards, ranges)]
    reduced = parts[0][2] + parts[1][2]
    results = [fce.calculate_cross_entropy_loss(p[3], reduced.clone()) for p in parts]
    ref = F.cross_entropy(logits.view(-1, 11), target.view(-1), reduction="none").view(5, 3)
    torch.testing.assert_close(results[0][1], ref, rtol=1e-6, atol=1e-6)
    grad_out = torch.rand(5, 3)
    x = logits.clone().requires_grad_()
    (F.cross_entropy(x.view(-1, 11), target.view(-1), reduction="none").view(5, 3) * grad_out).sum().backward()
    grads = torch.cat([fce.calculate_gradients(r[0], grad_out, p[0], p[1]) for r, p in zip(results, parts)], -1)
    assert grads.dtype == torch.bfloat16
    torch.testing.assert_close(grads.float(), x.grad, rtol=1e-2, atol=1e-2)


def test_safe_globals_allow_weights_only_load_of_megatron_objects():
    import megatron.core
    from megatron.core.enums import ModelType
    from megatron.core.optimizer import OptimizerConfig
    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(lr=0.5), "opt": OptimizerConfig(lr=2.0), "kind": ModelType.encoder_or_decoder,
                "rng": torch.Generator().get_state()}, buf)
    megatron.core.register_safe_globals()
    loaded = megatron.core.safe_load_from_bytes(buf.getvalue())
    assert loaded["args"].lr == 0.5 and loaded["opt"].lr == 2.0 and loaded["kind"] is ModelType.encoder_or_decoder


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


def test_sampling_params_token_counts_and_termination_id():
    from megatron.core.inference import InferenceEngine, SamplingParams
    torch.manual_seed(0)
    config = tiny_config(num_layers=1, hidden_size=16, num_attention_heads=2)
    model = tiny_gpt(config, 32, 16, share_embeddings_and_output_weights=False).eval()
    engine = InferenceEngine(model, max_batch_size=2, max_sequence_length=16)
    prompt = [1, 2, 3, 4]
    until_full, total = engine.generate([prompt, prompt], [SamplingParams(top_k=1),
                                                         SamplingParams(top_k=1, num_tokens_total=7)])
    assert len(until_full.generated_tokens) == 12 and len(total.generated_tokens) == 3  # 16 - 4 and 7 - 4
    assert until_full.generated_tokens[:3] == total.generated_tokens  # greedy: the same continuation
    stop = until_full.generated_tokens[1]
    first = until_full.generated_tokens.index(stop)
    ended = engine.generate([prompt], SamplingParams(top_k=1, termination_id=stop))[0]
    assert ended.generated_tokens == until_full.generated_tokens[:first + 1] and ended.finish_reason == "stop"
    for bad in (dict(top_n_logprobs=2), dict(return_segments=True), dict(num_tokens_total=2)):
        with pytest.raises(ValueError):
            engine.check_request(len(prompt), SamplingParams(**bad))


def test_process_group_helper_meta_guards_vpp_size():
    from megatron.core.process_groups_config import ProcessGroupHelperMeta

    class Holder(metaclass=ProcessGroupHelperMeta):
        pass

    Holder.other = 1
    with pytest.raises(AttributeError, match="set_virtual_pipeline_model_parallel_size"):
        Holder.virtual_pipeline_model_parallel_size = 2


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
