"""Multi-latent attention (q and kv low rank, YaRN) against a plain reference (one process, fp32)."""
import math

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from tests.fixtures.tiny_gpt import tiny_mla_config as _cfg

S, B, H, N = 8, 2, 32, 4
# fp32 on CPU; the references reorder sums (einsum vs. GEMM + SDPA): 1e-5 covers that rounding.
TOL = dict(rtol=1e-5, atol=1e-5)


def _reference_yarn(dim, base, factor, orig_len, beta_fast, beta_slow, mscale, mscale_all_dim):
    """YaRN from its definition, one frequency at a time: frequency i turns r_i = L / (2 pi base^(2i/d))
    times over the original context L; frequencies turning more than beta_fast times keep theta_i, fewer
    than beta_slow are divided by the factor, and in between they blend linearly in i (DeepSeek rounds
    the blend's bounds outwards to whole indices)."""
    def index_with_turns(turns):  # solve L * base^(-2i/d) / (2 pi) = turns for i
        return dim * math.log(orig_len / (2 * math.pi * turns)) / (2 * math.log(base))
    low = max(math.floor(index_with_turns(beta_fast)), 0)
    high = min(math.ceil(index_with_turns(beta_slow)), dim - 1)
    inv_freq = []
    for i in range(dim // 2):
        theta = base ** (-2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep theta, 1: theta / factor
        inv_freq.append(theta * (1 - ramp) + theta / factor * ramp)

    def m(scale_coef):
        return 0.1 * scale_coef * math.log(factor) + 1.0
    return torch.tensor(inv_freq), m(mscale) / m(mscale_all_dim), m(mscale_all_dim) ** 2


def _rotate(x, angles, m):
    """[s, b, n, d] by [s, d/2] angles in DeepSeek's (and Megatron's MLA) layout: channel pairs (x0, x1), (x2, x3)...
    each turned by its angle, scaled by the concentration m."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    cos, sin = angles.cos()[:, None, None] * m, angles.sin()[:, None, None] * m
    return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2)


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_mla(attn, cfg, x):
    """MLA written out with einsum from the module's weights (no TP)."""
    qk, pe, hv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        q = x @ attn.linear_q_proj.weight.t()
    else:
        q = _rms(x @ attn.linear_q_down_proj.weight.t(), attn.q_layernorm.weight) @ attn.linear_q_up_proj.weight.t()
    q = q.view(S, B, N, qk + pe)
    latent = x @ attn.linear_kv_down_proj.weight.t()
    c, k_pe = latent[..., :cfg.kv_lora_rank], latent[..., cfg.kv_lora_rank:]
    kv = (_rms(c, attn.kv_layernorm.weight) @ attn.linear_kv_up_proj.weight.t()).view(S, B, N, qk + hv)
    inv_freq, m, softmax_m2 = _reference_yarn(pe, cfg.rotary_base, cfg.rotary_scaling_factor,
                                              cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow,
                                              cfg.mscale, cfg.mscale_all_dim)
    angles = torch.arange(S, dtype=torch.float32)[:, None] * inv_freq
    query = torch.cat([q[..., :qk], _rotate(q[..., qk:], angles, m)], dim=-1)
    key = torch.cat([kv[..., :qk], _rotate(k_pe[:, :, None], angles, m).expand(S, B, N, pe)], dim=-1)
    scores = torch.einsum("sbnd,tbnd->bnst", query, key) * softmax_m2 / math.sqrt(qk + pe)
    scores = scores.masked_fill(torch.triu(torch.ones(S, S, dtype=torch.bool), 1), float("-inf"))
    ctx = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), kv[..., qk:]).reshape(S, B, N * hv)
    return ctx @ attn.linear_proj.weight.t()


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_mla_attention_matches_reference(q_lora_rank):
    cfg = _cfg(q_lora_rank=q_lora_rank)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True,
                                    normalization="RMSNorm").submodules.self_attention
    torch.manual_seed(0)
    attn = MLASelfAttention(cfg, spec.submodules, layer_number=1, **spec.params)
    for p in attn.parameters():  # norms away from 1 so that a missing norm shows
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3)
    x = torch.randn(S, B, H)
    out, bias = attn(x)
    assert bias is None
    torch.testing.assert_close(out, _reference_mla(attn, cfg, x), **TOL)


def test_cudnn_path_takes_the_value_at_its_own_head_dim(monkeypatch):
    """Where cuDNN attention applies (CUDA, Hopper; emulated here), MLA's values reach it at v_head_dim, unpadded,
    and its [b, n, s, v] output becomes the layer's context: the result equals the reference; when cuDNN
    refuses (None), the padded path gives the same."""
    import torch.nn.functional as F

    from megatron.core.transformer import dot_product_attention as dpa

    cfg = _cfg(q_lora_rank=12)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True,
                                    normalization="RMSNorm").submodules.self_attention
    torch.manual_seed(0)
    attn = MLASelfAttention(cfg, spec.submodules, layer_number=1, **spec.params)
    x = torch.randn(S, B, H)
    seen = []

    def cudnn(q, k, v, causal, scale):
        seen.append((q.size(-1), v.size(-1), causal))
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    monkeypatch.setattr(dpa, "cudnn_narrow_v_usable", lambda q, v: True)
    monkeypatch.setattr(dpa, "cudnn_narrow_v_attention", cudnn)
    out = attn(x)[0]
    assert seen == [(cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim, True)]
    torch.testing.assert_close(out, _reference_mla(attn, cfg, x), **TOL)
    monkeypatch.setattr(dpa, "cudnn_narrow_v_attention", lambda *a: None)
    torch.testing.assert_close(attn(x)[0], out, **TOL)
