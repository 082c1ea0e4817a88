"""MultimodalRotaryEmbedding against the per-section mRoPE formula (its context-parallel split is checked
on 2 gloo ranks in test_mtp_api.py)."""

import pytest
import torch

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding, RotaryEmbedding

KV, SECTION, BASE = 16, [2, 3, 3], 10000  # rot_dim / 2 = 8 frequency bands: 2 temporal, 3 height, 3 width


def _positions(b=2, s=6, seed=0):
    return torch.randint(0, 50, (3, b, s), generator=torch.Generator().manual_seed(seed))


def _reference(q, pos, interleaved):
    """Rotate each channel pair (j, j + d/2), or (2j, 2j+1) interleaved, by pos[c(j)] * base^(-2j/d),
    c(j) the section (t, h, w) that band j falls in. q: [s, b, n, d]; pos: [3, b, s]."""
    d = q.shape[-1]
    out = q.clone()
    for j in range(d // 2):
        c = 0 if j < SECTION[0] else 1 if j < SECTION[0] + SECTION[1] else 2
        angle = pos[c].t().double()[:, :, None] * BASE ** (-2 * j / d)  # [s, b, 1]
        cos, sin = torch.cos(angle), torch.sin(angle)
        a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + d // 2)
        x, y = q[..., a].double(), q[..., b].double()
        out[..., a], out[..., b] = (x * cos - y * sin).float(), (y * cos + x * sin).float()
    return out


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_matches_per_section_formula(interleaved):
    rope = MultimodalRotaryEmbedding(KV, 1.0, rotary_interleaved=interleaved, rotary_base=BASE)
    pos = _positions()
    emb = rope(pos, SECTION)
    assert emb.shape == (6, 2, 1, KV)
    q = torch.randn(6, 2, 3, KV, generator=torch.Generator().manual_seed(1))
    # float32 angles (positions < 50) and sin/cos: ~1e-5 absolute on O(1) values.
    torch.testing.assert_close(apply_rotary_pos_emb(q, emb, rotary_interleaved=interleaved),
                               _reference(q, pos, interleaved), atol=2e-5, rtol=1e-5)


def test_mrope_text_tokens_are_plain_rope_and_interpolation():
    """Equal (t, h, w) positions: every band sees the same position, i.e. 1-D RoPE."""
    s = 10
    pos = torch.arange(s).expand(3, 1, s)
    torch.testing.assert_close(MultimodalRotaryEmbedding(KV, 1.0)(pos, SECTION), RotaryEmbedding(KV, 1.0)(s))
    torch.testing.assert_close(MultimodalRotaryEmbedding(KV, 1.0, seq_len_interpolation_factor=2.0)(pos, SECTION),
                               RotaryEmbedding(KV, 1.0, seq_len_interpolation_factor=2.0)(s))
    with pytest.raises(ValueError, match="must sum to rot_dim / 2 = 8"):
        MultimodalRotaryEmbedding(KV, 1.0)(pos, [2, 2, 2])
