"""--window-size on CUDA: bf16 SDPA with the band mask agrees with an fp64 softmax reference (GPU machine)."""
import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = pytest.mark.gpu


def test_sliding_window_attention_matches_reference():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    s, b, heads, groups, hn, left = 512, 2, 8, 2, 64, 127
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * hn, num_attention_heads=heads, num_query_groups=groups,
                            attention_dropout=0.0, window_size=(left, 0))
    q = torch.randn(s, b, heads, hn, device="cuda").bfloat16()
    k, v = (torch.randn(s, b, groups, hn, device="cuda").bfloat16() for _ in range(2))
    out = DotProductAttention(cfg, 1, AttnMaskType.causal)(q, k, v)  # [s, b, heads * hn]
    i, j = torch.arange(s, device="cuda")[:, None], torch.arange(s, device="cuda")[None, :]
    keep = (j <= i) & (j >= i - left)
    qd, kd, vd = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, hn]
    kd, vd = kd.repeat_interleave(heads // groups, 1), vd.repeat_interleave(heads // groups, 1)
    scores = (qd @ kd.transpose(-1, -2)) * hn ** -0.5
    ref = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ vd
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, heads * hn)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2  # bf16 inputs and output: a few roundings of 2^-8
