"""Single-process checks of the model pieces against hand-written references."""
import torch
import torch.nn.functional as F

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import Float16Module
from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt

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


def test_rope_relative_and_interleaved():
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)
    freqs = rope(S)  # [s, 1, 1, 8]
    q = torch.randn(1, 1, 1, 8).expand(S, 1, 1, 8)
    rq = apply_rotary_pos_emb(q, freqs)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    # <R_i q, R_j q> depends only on i - j.
    dots = torch.einsum("sd,td->st", rq[:, 0, 0], rq[:, 0, 0])
    torch.testing.assert_close(dots[1, 0], dots[4, 3], rtol=1e-5, atol=1e-5)
    # Interleaved layout is the same rotation on a permuted channel order.
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    rope_i = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_interleaved=True)
    ri = apply_rotary_pos_emb(q[..., perm], rope_i(S), rotary_interleaved=True)
    torch.testing.assert_close(ri, rq[..., perm], rtol=1e-5, atol=1e-6)
    # rotary_percent: the last half of the channels passes through untouched.
    half = apply_rotary_pos_emb(q, RotaryEmbedding(8, 0.5)(S))
    torch.testing.assert_close(half[..., 4:], q[..., 4:])


def test_rope_half_by_half_equals_textbook_form():
    """The eager path (--no-rope-fusion) rotates half by half; it must equal t*cos + rotate_half(t)*sin,
    values and gradients, also for a strided view (q out of a fused QKV), partial rotary and cos/sin whose
    halves differ."""
    from megatron.core.models.common.embeddings import rope_utils
    g = torch.Generator().manual_seed(0)
    for rot in (16, 12):
        qkv = torch.randn(5, 2, 3, 48, dtype=torch.float64, generator=g, requires_grad=True)
        q = qkv[..., :16]  # strided view
        freqs = torch.randn(5, 1, 1, rot, dtype=torch.float64, generator=g)
        ref = rope_utils._rope(q, freqs, 0.7, False)
        out = rope_utils._rope_eager(q, freqs, 0.7, False)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        grad = torch.randn(ref.shape, dtype=torch.float64, generator=g)
        (g_ref,), (g_out,) = (torch.autograd.grad(y, qkv, grad) for y in (ref, out))
        torch.testing.assert_close(g_out, g_ref, rtol=1e-12, atol=1e-12)


def _gpt(cfg, share_embeddings_and_output_weights=False, **kw):
    return tiny_gpt(cfg, max_sequence_length=S, share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                    **kw)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (B, S), generator=g)
    return ids, torch.arange(S).expand(B, S)


def test_swiglu_model_and_full_recompute_same_grads():
    kw = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    ids, pos = _batch()
    grads = []
    for extra in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                  dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
                  dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"])):
        model = _gpt(_cfg(**kw, **extra), position_embedding_type="rope")
        loss = model(ids, pos, None, labels=ids)
        assert loss.shape == (B, S) and loss.dtype == torch.float32
        loss.mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for g in grads[1:]:  # recompute replays the same math: equal up to fp32 rounding
        torch.testing.assert_close(g, grads[0], rtol=1e-5, atol=1e-7)


def test_swiglu_fc1_layout():
    cfg = _cfg(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    model = _gpt(cfg)
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(S, B, 32)
    gate, up = mlp.linear_fc1.weight.chunk(2, dim=0)  # TP=1 layout: [gate; up]
    ref = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), mlp.linear_fc2.weight)
    torch.testing.assert_close(mlp(x)[0], ref, rtol=1e-5, atol=1e-6)
    assert mlp.linear_fc1.weight.partition_stride == 2


def test_float16_module_and_logits():
    cfg = _cfg(bf16=True)
    model = Float16Module(cfg, _gpt(cfg, share_embeddings_and_output_weights=True))
    ids, pos = _batch()
    assert next(model.parameters()).dtype == torch.bfloat16
    loss = model(ids, pos, None, labels=ids)
    assert loss.dtype == torch.float32
    logits = model(ids, pos, None)
    assert logits.shape == (B, S, 64) and logits.dtype == torch.float32
    assert model.module.embedding.word_embeddings.weight.shared_embedding


def test_same_seed_same_weights_and_load_state_dict():
    a, b = _gpt(_cfg()), _gpt(_cfg(seed=7))
    c = _gpt(_cfg())
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert torch.equal(pa[name], pc[name]) and not torch.equal(pa[name], pb[name])
    b.load_state_dict(a.state_dict())
    assert torch.equal(dict(b.named_parameters())[name], pa[name])


def test_rope_fusion_flag_selects_the_fused_kernel(monkeypatch):
    """Megatron's default (rope fusion on) reaches the config and picks the compiled RoPE (eager on CPU,
    so equal here); --no-rope-fusion picks the eager one."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.training.arguments import core_transformer_config_from_args
    from tests.unit.test_arguments import _args
    on = core_transformer_config_from_args(_args(""))
    off = core_transformer_config_from_args(_args("--no-rope-fusion"))
    assert on.apply_rope_fusion and not off.apply_rope_fusion
    calls = []
    monkeypatch.setattr(rope_utils, "_rope_fused", lambda *a: calls.append(1) or rope_utils._rope(*a))
    t, freqs = torch.randn(8, 2, 4, 16), torch.randn(8, 1, 1, 12)
    torch.testing.assert_close(rope_utils.apply_rotary_pos_emb(t, freqs, config=on),
                               rope_utils.apply_rotary_pos_emb(t, freqs, config=off))
    assert calls == [1]


def test_embedding_wgrad_goes_into_main_grad():
    """With gradient_accumulation_fusion the embedding's weight gradient is accumulated into the DDP
    buffer (main_grad) row by row; it must equal the dense gradient, with repeated ids summed. A tied
    embedding (zero_out_wgrad) and a weight without main_grad keep the ordinary dense .grad."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 7), generator=g)
    ids[0, :3] = 5  # repeated rows accumulate
    for case in ("fused", "tied", "no_main_grad", "off"):
        cfg = ModelParallelConfig(gradient_accumulation_fusion=case != "off")
        emb = VocabParallelEmbedding(50, 8, init_method=torch.nn.init.normal_, config=cfg)
        if case != "no_main_grad":
            emb.weight.main_grad = torch.ones(50, 8)
            emb.weight.grad_added_to_main_grad = False
        if case == "tied":
            emb.weight.zero_out_wgrad = True
        out = emb(ids)
        grad = torch.randn(out.shape, generator=g)
        out.backward(grad)
        dense = torch.zeros(50, 8).index_add_(0, ids.flatten(), grad.reshape(-1, 8))
        if case == "fused":
            torch.testing.assert_close(emb.weight.main_grad - 1, dense, rtol=1e-6, atol=1e-6)
            assert emb.weight.grad_added_to_main_grad
        else:
            torch.testing.assert_close(emb.weight.grad, dense, rtol=1e-6, atol=1e-6)
            if case != "no_main_grad":
                assert torch.equal(emb.weight.main_grad, torch.ones(50, 8))
