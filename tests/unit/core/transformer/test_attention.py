"""SelfAttention with grouped query heads against a hand-written reference (one process, fp32)."""
import torch
import torch.nn.functional as F

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention
from tests.fixtures.tiny_gpt import tiny_config

S, B = 6, 2


def _cfg(**kw):
    base = dict(num_query_groups=2, use_cpu_initialization=True)  # CPU references, even on a GPU host
    base.update(kw)
    return tiny_config(**base)


def _attention(cfg):
    spec = get_gpt_layer_local_spec().submodules.self_attention
    return SelfAttention(cfg, spec.submodules, layer_number=1, **spec.params)


def test_gqa_attention_matches_reference():
    cfg = _cfg()
    attn = _attention(cfg)
    x = torch.randn(S, B, 32)
    out, bias = attn(x)
    out = out + bias
    # Reference: QKV rows are per query group [q0 q1 k v] (np/ng = 2 heads per group, hn = 8).
    w = attn.linear_qkv.weight.view(2, 4, 8, 32)  # [ng, np/ng + 2, hn, h]
    bq = attn.linear_qkv.bias.view(2, 4, 8)
    proj = torch.einsum("sbh,gjdh->sbgjd", x, w) + bq  # [s, b, ng, 4, hn]
    q = proj[:, :, :, :2].reshape(S, B, 4, 8)
    k = proj[:, :, :, 2].repeat_interleave(2, dim=2)
    v = proj[:, :, :, 3].repeat_interleave(2, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / 8 ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(S, S, dtype=torch.bool), 1), float("-inf"))
    ctx = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(S, B, 32)
    ref = F.linear(ctx, attn.linear_proj.weight, attn.linear_proj.bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # An explicit causal mask (True = masked) gives the same result as the is_causal path.
    mask = torch.triu(torch.ones(B, 1, S, S, dtype=torch.bool), 1)
    torch.testing.assert_close(attn(x, attention_mask=mask)[0] + bias, ref, rtol=1e-5, atol=1e-5)
