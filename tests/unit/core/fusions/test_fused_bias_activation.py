"""The fused bias-activation choice and its math against eager."""
import torch


def test_fused_bias_activation_choice_and_math():
    import torch.nn.functional as F

    from megatron.core.fusions import fused_bias_activation as fba
    assert fba.fused_bias_activation(F.silu, gated=True) is fba.bias_swiglu
    assert fba.fused_bias_activation(F.gelu, gated=False) is fba.bias_gelu
    assert fba.fused_bias_activation(fba.openai_gelu, gated=False) is fba.bias_gelu_tanh
    assert fba.fused_bias_activation(F.relu, gated=False) is None
    x, b = torch.randn(4, 2, 16), torch.randn(16)
    gate, up = torch.chunk(x + b, 2, dim=-1)
    torch.testing.assert_close(fba.bias_swiglu(x, b), F.silu(gate) * up)
    torch.testing.assert_close(fba.bias_gelu(x, None), F.gelu(x))
