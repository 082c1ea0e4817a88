"""The SwiGLU MLP's fused fc1 ([gate; up]) against the unfused formula."""
import torch
import torch.nn.functional as F

from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt

S, B = 6, 2


def _cfg(**kw):
    base = dict(num_query_groups=2, use_cpu_initialization=True)  # CPU references, even on a GPU host
    base.update(kw)
    return tiny_config(**base)


def _gpt(cfg, share_embeddings_and_output_weights=False, **kw):
    return tiny_gpt(cfg, max_sequence_length=S, share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                    **kw)


def test_swiglu_fc1_layout():
    cfg = _cfg(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    model = _gpt(cfg)
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(S, B, 32)
    gate, up = mlp.linear_fc1.weight.chunk(2, dim=0)  # TP=1 layout: [gate; up]
    ref = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), mlp.linear_fc2.weight)
    torch.testing.assert_close(mlp(x)[0], ref, rtol=1e-5, atol=1e-6)
    assert mlp.linear_fc1.weight.partition_stride == 2
