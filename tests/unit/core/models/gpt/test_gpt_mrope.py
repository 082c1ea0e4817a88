"""GPTModel with --position-embedding-type mrope: on text positions (t = h = w) it is the RoPE model with the
same weights, in a full forward and through the generation engine's KV cache; 3-D positions change the
logits. (Logits against transformers' Qwen2.5-VL: tests/functional/test_hf_conversion_qwen2_5_vl.py.)

fp32 on CPU: the mRoPE angles are the same products as RoPE's, so the forwards agree to ~1e-7.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.inference import InferenceEngine, SamplingParams
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt

VOCAB, SEQ, SECTION = 96, 12, [2, 3, 3]  # head dim 16: 8 frequency bands


def _pair():
    """(rope model, mrope model) with the same weights."""
    cfg = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
               normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
               add_qkv_bias=True)
    model_parallel_cuda_manual_seed(3)
    rope = tiny_gpt(tiny_config(**cfg), VOCAB, 64, spec=get_gpt_layer_local_spec(), position_embedding_type="rope",
                    share_embeddings_and_output_weights=False).eval()
    mrope = tiny_gpt(tiny_config(mrope_section=SECTION, **cfg), VOCAB, 64, spec=get_gpt_layer_local_spec(),
                     position_embedding_type="mrope", share_embeddings_and_output_weights=False).eval()
    mrope.load_state_dict(rope.state_dict())
    return rope, mrope


def test_text_positions_equal_rope_and_3d_positions_differ():
    rope, mrope = _pair()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        want = rope(ids, pos, None)
        for p in (pos, pos.expand(3, 2, SEQ), None):
            torch.testing.assert_close(mrope(ids, p, None), want, rtol=1e-5, atol=1e-6)
        image = pos.expand(3, 2, SEQ).clone()
        image[1, :, 4:8], image[2, :, 4:8] = 4 + torch.tensor([0, 0, 1, 1]), 4 + torch.tensor([0, 1, 0, 1])
        # small random weights: the logits move by ~1e-4, far above the ~1e-7 agreement of the forwards above
        assert (mrope(ids, image, None) - want).abs().max() > 2e-5


def test_generation_equals_rope():
    """Greedy tokens and log-probs through the KV cache (prefill, then decode steps)."""
    rope, mrope = _pair()
    prompts = [[3, 14, 15, 92, 65], [35, 89]]
    params = SamplingParams(top_k=1, num_tokens_to_generate=6, return_log_probs=True)
    want = InferenceEngine(rope, max_batch_size=2, max_sequence_length=32).generate(prompts, params)
    got = InferenceEngine(mrope, max_batch_size=2, max_sequence_length=32).generate(prompts, params)
    for a, b in zip(got, want):
        assert a.generated_tokens == b.generated_tokens
        torch.testing.assert_close(torch.tensor(a.generated_log_probs), torch.tensor(b.generated_log_probs),
                                   rtol=0, atol=1e-5)


def test_mrope_needs_its_section():
    model_parallel_cuda_manual_seed(3)
    with pytest.raises(ValueError, match="needs --mrope-section"):
        tiny_gpt(tiny_config(), VOCAB, 64, position_embedding_type="mrope")
