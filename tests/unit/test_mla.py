"""Multi-latent attention, YaRN and multi-token prediction against plain references (one process, fp32)."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_config import MLATransformerConfig
from tests.fixtures.tiny_gpt import tiny_config

S, B, H, N = 8, 2, 32, 4
# fp32 on CPU; the references reorder sums (einsum vs. GEMM + SDPA): 1e-5 covers that rounding.
TOL = dict(rtol=1e-5, atol=1e-5)


def _cfg(**kw):
    base = dict(hidden_size=H, num_attention_heads=N, use_cpu_initialization=True, q_lora_rank=12, kv_lora_rank=10,
                qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rotary_scaling_factor=4.0, mscale=0.9,
                mscale_all_dim=0.7, rotary_base=100, original_max_position_embeddings=64, beta_fast=8, beta_slow=1,
                add_bias_linear=False)
    base.update(kw)
    return tiny_config(MLATransformerConfig, **base)


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


def _rotate(x, emb, m):  # [s, b, n, d] by [s, d] angles, halves layout, scaled by the concentration m
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = emb.cos()[:, None, None] * m, emb.sin()[:, None, None] * m
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


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
    emb = torch.cat([angles, angles], dim=-1)
    query = torch.cat([q[..., :qk], _rotate(q[..., qk:], emb, m)], dim=-1)
    key = torch.cat([kv[..., :qk], _rotate(k_pe[:, :, None], emb, m).expand(S, B, N, pe)], dim=-1)
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


def _mtp_model(**kw):
    cfg = _cfg(mtp_num_layers=2, mtp_loss_scaling_factor=0.3, rope_type="rope", **kw)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    torch.manual_seed(0)
    return GPTModel(cfg, spec, vocab_size=40, max_sequence_length=S, position_embedding_type="rope",
                    mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec)), cfg


def _reference_mtp_objective(model, cfg, ids, pos, labels, mask):
    """LM loss mean + scale/D * sum_k (MTP depth k mean loss), from the model's pieces called in plain
    order: depth k embeds the inputs rolled left by k and predicts the labels rolled left by k."""
    hidden = model.decoder(model.embedding(ids, pos), None)
    logits = hidden @ model.output_layer.weight.t()  # [s, b, V]
    token_loss = F.cross_entropy(logits.flatten(0, 1), labels.t().flatten(), reduction="none").view(S, B).t()
    objective = (token_loss * mask).sum() / mask.sum()
    stats = []
    for k, layer in enumerate(model.mtp.layers, start=1):
        shifted = torch.cat([ids[:, k:], torch.zeros_like(ids[:, :k])], dim=1)
        shifted_pos = torch.cat([pos[:, k:], torch.zeros_like(pos[:, :k])], dim=1)
        e = model.embedding(shifted, shifted_pos)
        x = torch.cat([_rms(e, layer.enorm.weight), _rms(hidden, layer.hnorm.weight)], dim=-1)
        x = x @ layer.eh_proj.weight.t()
        hidden = _rms(layer.transformer_layer(x)[0], layer.final_layernorm.weight)
        k_labels = torch.cat([labels[:, k:], torch.zeros_like(labels[:, :k])], dim=1)
        k_mask = torch.cat([mask[:, k:], torch.zeros_like(mask[:, :k])], dim=1)
        k_logits = hidden @ model.output_layer.weight.t()
        k_loss = F.cross_entropy(k_logits.flatten(0, 1), k_labels.t().flatten(), reduction="none").view(S, B).t()
        stats.append(((k_loss * k_mask).sum(), k_mask.sum()))
        objective = objective + cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers * stats[-1][0] / stats[-1][1]
    return objective, stats


def test_mtp_loss_and_gradients_match_plain_reference():
    model, cfg = _mtp_model()
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 40, (B, S), generator=g), torch.randint(0, 40, (B, S), generator=g)
    pos = torch.arange(S).expand(B, S)
    mask = (torch.rand(B, S, generator=g) > 0.2).float()
    out = model(ids, pos, None, labels=labels, loss_mask=mask)  # per-token LM loss, MTP attached
    (out * mask).sum().div(mask.sum()).backward()  # the GPT loss function: masked token mean
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    stats = model.mtp_loss_stats
    model.zero_grad()
    objective, ref_stats = _reference_mtp_objective(model, cfg, ids, pos, labels, mask)
    objective.backward()
    for (got_sum, got_n), (ref_sum, ref_n) in zip(stats, ref_stats):
        torch.testing.assert_close(got_sum, ref_sum.detach(), **TOL)
        assert got_n == ref_n
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)
    assert grads["mtp.layers.1.eh_proj.weight"].abs().sum() > 0
    # Evaluation (and logits) see the main prediction only.
    model.eval()
    torch.testing.assert_close(model(ids, pos, None, labels=labels), out.detach(), **TOL)
    assert model.mtp_loss_stats is None


def _args(extra, world_size=1):
    from megatron.training.arguments import parse_args, validate_args
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
            "--micro-batch-size 2 --train-iters 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 64 --multi-latent-attention ").split()
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), "0"
    try:
        return validate_args(parse_args(argv=base + extra.split()))
    finally:
        del os.environ["WORLD_SIZE"], os.environ["RANK"]


@pytest.mark.parametrize("extra, world_size, message", [
    ("--kv-lora-rank 0", 1, "--kv-lora-rank (0) must be set"),
    ("--attention-backend flash --qk-head-dim 256", 1, "--attention-backend flash takes head dims up to 256"),
    ("--mtp-num-layers 1 --pipeline-model-parallel-size 2", 2, "--mtp-num-layers is not supported with "
                                                                "--pipeline-model-parallel-size > 1"),
    ("--group-query-attention --num-query-groups 2", 1, "--group-query-attention cannot be combined"),
    ("--context-parallel-size 2 --attention-dropout 0", 2,
     "--multi-latent-attention is not supported with --context-parallel-size"),
])
def test_bad_mla_and_mtp_flags_get_one_line(extra, world_size, message):
    from megatron.training.arguments import ArgumentError
    with pytest.raises(ArgumentError) as err:
        _args(extra, world_size)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_flags_map_to_mla_config_and_flops():
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.flops import num_floating_point_operations
    a = _args("--q-lora-rank 16 --kv-lora-rank 12 --qk-head-dim 8 --qk-pos-emb-head-dim 4 --v-head-dim 6 "
              "--rotary-scaling-factor 4 --mscale 0.9 --mscale-all-dim 0.7 --position-embedding-type yarn "
              "--yarn-original-max-position-embeddings 8 --yarn-beta-fast 16 --normalization RMSNorm "
              "--qk-layernorm --disable-bias-linear --swiglu --mtp-num-layers 1 --mtp-loss-scaling-factor 0.2")
    cfg = core_transformer_config_from_args(a)
    assert isinstance(cfg, MLATransformerConfig) and cfg.rope_type == "yarn"
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (
        16, 12, 8, 4, 6)
    assert (cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim) == (4.0, 0.9, 0.7)
    assert (cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow) == (8, 16.0, 1)
    assert (cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor) == (1, 0.2)
    # FLOPs: every attention weight is used once per token (6 FLOPs: fwd + 2 bwd GEMMs, 2 per MAC), plus
    # the causal core attention; an MTP depth adds a layer, its eh_proj/norms and one more logits pass.
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    attn = MLASelfAttention(cfg, spec.submodules.self_attention.submodules, layer_number=1)
    attn_params = sum(p.numel() for p in attn.parameters())
    a.padded_vocab_size = 128
    h, s, f, layers = 32, a.seq_length, a.ffn_hidden_size, 2 + 1
    core = s * 4 * (8 + 4 + 6) / 2  # QK^T over qk + pe dims and AV over v dims, half under the causal mask
    expected = (layers * 6 * (3 * h * f + attn_params + core)  # SwiGLU MLP and attention per layer
                + 6 * (3 * h + 2 * h * h)  # MTP norms and eh_proj
                + 2 * 6 * h * 128)  # logits for the main head and the MTP depth
    assert num_floating_point_operations(a, 3) == pytest.approx(3 * s * expected, rel=1e-12)


def test_moe_flops_count_active_experts_and_mtp_depth():
    from types import SimpleNamespace

    from megatron.training.flops import num_floating_point_operations
    base = dict(hidden_size=32, num_layers=3, seq_length=16, num_attention_heads=4, kv_channels=8,
                group_query_attention=False, num_query_groups=4, ffn_hidden_size=64, swiglu=True,
                padded_vocab_size=128, vocab_size=128, mtp_num_layers=1, multi_latent_attention=False)
    dense = num_floating_point_operations(SimpleNamespace(**base, num_experts=None), 2)
    moe = num_floating_point_operations(SimpleNamespace(**base, num_experts=8, moe_layer_freq=[0, 1, 1],
                                                        moe_ffn_hidden_size=16, moe_router_topk=2,
                                                        moe_shared_expert_intermediate_size=16), 2)
    # 1 dense layer keeps 64; 2 MoE layers + the MTP depth (the last layer is MoE) run 2 x 16 + 16 = 48.
    assert moe - dense == 2 * 16 * 6 * 32 * 3 * (64 + 3 * 48 - 4 * 64)
