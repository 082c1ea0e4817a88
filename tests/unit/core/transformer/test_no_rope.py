"""--no-rope-freq (NoPE layers): the pattern Megatron reads (every N-th layer, or a 0/1 list); a model whose every
layer skips RoPE is the same model without position embeddings, in training and in generation (whose fused decode
path would otherwise rotate the keys); a mixed pattern rotates only the other layers."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.inference import InferenceEngine, SamplingParams
from megatron.core.transformer.no_rope import layer_skips_rope, no_rope_pattern
from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt
from tests.unit.core.inference.test_cuda_graphs import MAX_LEN, VOCAB, _prompts


def test_pattern_as_megatron_reads_it():
    assert no_rope_pattern(4, 8) == [0, 0, 0, 1, 0, 0, 0, 1]
    assert no_rope_pattern([1, 0], 2) == [1, 0] and no_rope_pattern(None, 4) is None
    assert layer_skips_rope([0, 1], 2) and not layer_skips_rope([0, 1], 1) and not layer_skips_rope(None, 1)
    with pytest.raises(ValueError, match="must be a multiple of it"):
        no_rope_pattern(3, 8)
    with pytest.raises(ValueError, match="one 0/1 entry per layer"):
        no_rope_pattern([1, 0, 1], 2)


def _model(position_embedding_type, **overrides):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(3)
    torch.manual_seed(3)
    cfg = tiny_config(hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                      normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                      init_method_std=0.1, **overrides)
    return tiny_gpt(cfg, VOCAB, MAX_LEN, position_embedding_type=position_embedding_type,
                    share_embeddings_and_output_weights=False).eval()


def test_all_nope_layers_are_the_model_without_position_embeddings():
    none = _model("none")
    nope = _model("rope", no_rope_freq=[1, 1])
    nope.load_state_dict(none.state_dict())
    mixed = _model("rope", no_rope_freq=[0, 1])
    mixed.load_state_dict(none.state_dict())
    rope = _model("rope")
    rope.load_state_dict(none.state_dict())
    ids = torch.tensor(_prompts([12], seed=1))
    pos = torch.arange(12)[None]
    with torch.no_grad():
        out = {name: m(ids, pos, None) for name, m in (("none", none), ("nope", nope), ("mixed", mixed),
                                                         ("rope", rope))}
    torch.testing.assert_close(out["nope"], out["none"], rtol=0, atol=0)
    assert not torch.allclose(out["mixed"], out["none"]) and not torch.allclose(out["mixed"], out["rope"])

    # Generation: prefill and decode (the fused decode path applies RoPE itself) skip it in NoPE layers too.
    params = [SamplingParams(top_k=1, num_tokens_to_generate=5, return_log_probs=True)]
    prompts = _prompts([9, 14], seed=2)
    a = InferenceEngine(none, max_batch_size=2, max_sequence_length=MAX_LEN).generate(prompts, params * 2)
    b = InferenceEngine(nope, max_batch_size=2, max_sequence_length=MAX_LEN).generate(prompts, params * 2)
    for x, y in zip(a, b):
        assert x.generated_tokens == y.generated_tokens
        torch.testing.assert_close(torch.tensor(y.generated_log_probs), torch.tensor(x.generated_log_probs),
                                   rtol=0, atol=1e-5)


def test_multi_latent_attention_refuses_it():
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    with pytest.raises(ValueError, match="--no-rope-freq is not supported with multi-latent attention"):
        tiny_config(MLATransformerConfig, multi_latent_attention=True, no_rope_freq=[0, 1], q_lora_rank=8,
                    kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
