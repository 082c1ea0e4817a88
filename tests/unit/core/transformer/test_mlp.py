"""The SwiGLU MLP's fused fc1 ([gate; up]) against the unfused formula."""
import torch
import torch.nn.functional as F

from tests.fixtures.tiny_gpt import cpu_reference_config as _cfg
from tests.fixtures.tiny_gpt import short_gpt as _gpt

S, B = 6, 2


def test_swiglu_fc1_layout():
    cfg = _cfg(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    model = _gpt(cfg)
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(S, B, 32)
    gate, up = mlp.linear_fc1.weight.chunk(2, dim=0)  # TP=1 layout: [gate; up]
    ref = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), mlp.linear_fc2.weight)
    torch.testing.assert_close(mlp(x)[0], ref, rtol=1e-5, atol=1e-6)
    assert mlp.linear_fc1.weight.partition_stride == 2
