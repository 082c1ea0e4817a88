"""Multi-latent attention on CUDA (bf16, DeepSeek-V3 head dims 128 + 64 / 128): every --attention-backend runs
(cuDNN at the value's own head dim under auto and fused; values zero-padded to the query/key head dim for flash)
and matches the fp32 CPU module. bf16 keeps ~3 significant digits through two projections and the softmax: 3e-2
relative to the output scale. The cuDNN path at the value's head dim equals the padded SDPA path, forward and
backward."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("backend", ["auto", "flash", "fused", "unfused"])
def test_mla_backends_match_fp32_reference(backend):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    def build(**kw):
        cfg = MLATransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=4, hidden_dropout=0.0,
                                   attention_dropout=0.0, q_lora_rank=256, kv_lora_rank=128, qk_head_dim=128,
                                   qk_pos_emb_head_dim=64, v_head_dim=128, rotary_scaling_factor=40.0,
                                   mscale=1.0, mscale_all_dim=1.0, add_bias_linear=False, attention_backend=backend,
                                   use_cpu_initialization=True, **kw)
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True,
                                        normalization="RMSNorm").submodules.self_attention
        torch.manual_seed(0)
        return MLASelfAttention(cfg, spec.submodules, layer_number=1, **spec.params)

    ref_attn = build()
    attn = build(bf16=True, params_dtype=torch.bfloat16)
    attn.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref_attn.state_dict().items()})
    attn = attn.cuda()
    x = torch.randn(256, 2, 512)
    ref = ref_attn(x)[0]
    out = attn(x.cuda().to(torch.bfloat16))[0].float().cpu()
    assert (out - ref).abs().max() <= 3e-2 * ref.abs().max()


def test_cudnn_at_the_value_head_dim_equals_the_padded_path():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron.core.context_parallel import kernels

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN attention here needs Hopper or newer")
    torch.manual_seed(0)
    b, n, s, dq, dv = 2, 8, 1024, 192, 128
    q, k = (torch.randn(b, n, s, dq, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(b, n, s, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert kernels.cudnn_narrow_v_usable(q, v)
    out = kernels.cudnn_narrow_v_attention(q, k, v, True, dq ** -0.5)
    assert out is not None and kernels._CUDNN_NARROW_V["ok"], "cuDNN refused d_qk 192 / d_v 128"
    assert out.shape == (b, n, s, dv)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        ref = F.scaled_dot_product_attention(q, k, F.pad(v, (0, dq - dv)), is_causal=True, scale=dq ** -0.5)
    ref = ref[..., :dv]
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert (out - ref).abs().max() <= 2e-2 * ref.abs().max()
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() <= 2e-2 * r.abs().max()
