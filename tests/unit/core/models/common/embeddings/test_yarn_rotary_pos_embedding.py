"""YaRN frequencies and mscale against the reference formula."""
import pytest
import torch

from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from tests.unit.core.transformer.test_multi_latent_attention import _reference_yarn


def test_yarn_frequencies_and_mscale_match_reference_formula():
    for dim, base, factor, orig, fast, slow in ((64, 10000, 40.0, 4096, 32, 1), (16, 500, 4.0, 64, 8, 2)):
        rope = YarnRotaryEmbedding(dim, rotary_base=base, scaling_factor=factor, original_max_position_embeddings=orig,
                                   beta_fast=fast, beta_slow=slow, mscale=0.9, mscale_all_dim=0.7,
                                   use_cpu_initialization=True)
        inv_freq, concentration, _ = _reference_yarn(dim, base, factor, orig, fast, slow, 0.9, 0.7)
        torch.testing.assert_close(rope.inv_freq, inv_freq, rtol=1e-6, atol=0)
        emb, mscale = rope(5)
        assert mscale == pytest.approx(concentration, rel=1e-12)
        positions = torch.arange(5, dtype=torch.float32)[:, None]
        torch.testing.assert_close(emb[:, 0, 0], torch.cat([positions * inv_freq] * 2, dim=-1), rtol=1e-6, atol=0)
    # Factor 1 is plain RoPE with no concentration.
    rope = YarnRotaryEmbedding(8, scaling_factor=1.0, use_cpu_initialization=True)
    torch.testing.assert_close(rope.inv_freq, 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
    assert rope(3)[1] == 1.0
