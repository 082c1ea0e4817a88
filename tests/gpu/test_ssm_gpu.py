"""SSM kernels on CUDA: mamba-ssm's Triton SSD scan and fla's chunked gated delta rule (fla's own, and fla's kernels
with the dq/dk/dw/dg backward step in PyTorch that Hopper with Triton 3.4-3.7 runs; each skipped when its package is
not installed) equal the eager chunked scans, forward and backward, on the same bf16 inputs; and
the Mamba-2 / Gated DeltaNet mixers in bf16 on CUDA match the fp32 CPU modules.
bf16 inputs, fp32 accumulation in both paths: outputs and grads agree to ~1e-2 of their scale (bf16 noise)."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = 2e-2


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def _ssd_inputs(b=2, l=512, h=8, p=64, g=2, n=64):
    gen = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", generator=gen)
    x = torch.randn(b, l, h, p, **kw).bfloat16()
    dt = F.softplus(torch.randn(b, l, h, **kw) - 2)  # fp32, as the mixer passes it
    A = -torch.rand(h, **kw) * 4 - 0.5
    B = torch.randn(b, l, g, n, **kw).bfloat16()
    C = torch.randn(b, l, g, n, **kw).bfloat16()
    D = torch.randn(h, **kw)
    return x, dt, A, B, C, D


@pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is None, reason="mamba-ssm not installed")
def test_mamba_ssm_triton_ssd_matches_eager():
    from megatron.core.ssm.ops.kernels import ssd_kernel
    from megatron.core.ssm.ops.ssd_reference import ssd_chunk_scan_torch
    kernel = ssd_kernel(torch.empty(1, device="cuda"))
    assert kernel is not ssd_chunk_scan_torch, "mamba-ssm is installed but its Triton SSD kernel did not load"
    inputs = _ssd_inputs()
    grads = []
    outs = []
    for fn in (kernel, ssd_chunk_scan_torch):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = fn(*leaves[:5], 128, D=leaves[5])
        y.float().pow(2).sum().backward()
        outs.append(y)
        grads.append([t.grad for t in leaves])
    assert _rel_err(outs[0], outs[1]) < TOL
    for name, a, b in zip("x dt A B C D".split(), *grads):
        assert _rel_err(a, b) < TOL, name


def _gdn_inputs(b, l, h, hv, dk, dv):
    gen = torch.Generator(device="cuda").manual_seed(l)
    kw = dict(device="cuda", generator=gen)
    q = F.normalize(torch.randn(b, l, h, dk, **kw), dim=-1).bfloat16()
    k = F.normalize(torch.randn(b, l, h, dk, **kw), dim=-1).bfloat16()
    v = torch.randn(b, l, hv, dv, **kw).bfloat16()
    g = F.logsigmoid(torch.randn(b, l, hv, **kw))  # log decay <= 0, fp32
    beta = torch.rand(b, l, hv, **kw).bfloat16()
    h0 = torch.randn(b, hv, dk, dv, **kw) * 0.1
    return q, k, v, g, beta, h0


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention not installed")
def test_fla_gated_delta_rule_matches_eager():
    from megatron.core.ssm.ops.gated_delta_reference import chunk_gated_delta_rule_torch
    from megatron.core.ssm.ops.kernels import _fla_unsafe_here, gated_delta_kernel
    unsafe = _fla_unsafe_here(torch.device("cuda"))
    if unsafe:
        pytest.skip(f"fla is not used on this machine: {unsafe}")
    kernel = gated_delta_kernel(torch.empty(1, device="cuda"))
    assert kernel is not chunk_gated_delta_rule_torch, "fla is installed but its kernel did not load"
    q, k, v, g, beta, _ = _gdn_inputs(2, 512, 4, 4, 128, 128)
    outs, grads = [], []
    for fn in (kernel, chunk_gated_delta_rule_torch):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        o, _ = fn(*leaves)
        o.float().pow(2).sum().backward()
        outs.append(o)
        grads.append([t.grad for t in leaves])
    assert _rel_err(outs[0], outs[1]) < TOL
    for name, a, b_ in zip("q k v g beta".split(), *grads):
        assert _rel_err(a, b_) < TOL, name


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention not installed")
@pytest.mark.parametrize("l", [512, 500])  # 500: a partial last chunk
def test_fla_with_torch_dqkwg_matches_eager(l):
    """fla's kernels with the PyTorch dq/dk/dw/dg step (what Hopper with Triton 3.4-3.7 runs; right everywhere) vs
    the eager scan in fp32 on the same bf16 values: Qwen3-Next-like heads (4 key heads, 8 value heads of 128), an
    initial state and the final state's gradient included."""
    from megatron.core.ssm.ops.gated_delta_reference import chunk_gated_delta_rule_torch
    try:
        from megatron.core.ssm.ops._fla_gated_delta import chunk_gated_delta_rule_torch_dqkwg, unsupported_reason
    except ImportError as e:
        pytest.skip(f"fla not importable: {e}")
    if unsupported_reason():
        pytest.skip(unsupported_reason())
    inputs = _gdn_inputs(2, l, 4, 8, 128, 128)
    outs, grads = [], []
    for fast in (True, False):
        leaves = [t.clone().requires_grad_() for t in inputs]
        q, k, v, g, beta, h0 = leaves
        if fast:
            o, state = chunk_gated_delta_rule_torch_dqkwg(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        else:  # fp32 reference; the eager scan takes one key head per value head
            q, k, v, beta = (t.float() for t in (q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, beta))
            o, state = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        (o.float().pow(2).sum() + state.float().pow(2).sum()).backward()
        outs.append((o, state))
        grads.append([t.grad for t in leaves])
    assert _rel_err(outs[0][0], outs[1][0]) < TOL
    assert _rel_err(outs[0][1], outs[1][1]) < TOL
    for name, a, b_ in zip("q k v g beta h0".split(), *grads):
        assert _rel_err(a, b_) < TOL, name


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention not installed")
def test_gated_delta_kernel_picks_fla_with_torch_dqkwg_where_fla_is_wrong():
    from megatron.core.ssm.ops import kernels
    kernel = kernels.gated_delta_kernel(torch.empty(1, device="cuda"))
    name = getattr(kernel, "__name__", "")
    if kernels._fla_unsafe_here(torch.device("cuda")):
        assert name == "chunk_gated_delta_rule_torch_dqkwg", name
    else:
        assert name == "chunk_gated_delta_rule", name


def test_gdn_mixer_backward_bf16_cuda_matches_fp32_cpu():
    """The Gated DeltaNet mixer's input and in_proj gradients in bf16 on CUDA (fla with the PyTorch step on Hopper
    with Triton 3.4-3.7, fla's own or the eager scan elsewhere) vs the fp32 CPU mixer; bf16 noise over two
    projections and the scan: 5e-2."""
    from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.fixtures.tiny_gpt import single_rank
    single_rank()

    def build(**kw):
        cfg = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8, hidden_dropout=0.0,
                                attention_dropout=0.0, normalization="RMSNorm", add_bias_linear=False,
                                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
                                linear_num_value_heads=8, use_cpu_initialization=True, **kw)
        torch.manual_seed(0)
        return GatedDeltaNet(cfg, get_hybrid_stack_spec().submodules.gdn_layer.submodules.self_attention.submodules)

    ref = build()
    fast = build(bf16=True, params_dtype=torch.bfloat16)
    fast.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    fast = fast.cuda()
    x = torch.randn(512, 2, 512)
    x_ref, x_fast = x.clone().requires_grad_(), x.cuda().bfloat16().requires_grad_()
    for module, inp in ((ref, x_ref), (fast, x_fast)):
        out, _ = module(inp)
        out.float().pow(2).sum().backward()
    assert _rel_err(x_fast.grad.cpu(), x_ref.grad) < 5e-2
    assert _rel_err(fast.in_proj.weight.grad.cpu(), ref.in_proj.weight.grad) < 5e-2


@pytest.mark.parametrize("kind", ["mamba", "gdn"])
def test_mixer_bf16_cuda_matches_fp32_cpu(kind):
    from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.fixtures.tiny_gpt import single_rank
    single_rank()

    def build(**kw):
        cfg = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8, hidden_dropout=0.0,
                                attention_dropout=0.0, normalization="RMSNorm", add_bias_linear=False,
                                mamba_state_dim=64, mamba_head_dim=64, mamba_num_groups=2, linear_key_head_dim=64,
                                linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                                use_cpu_initialization=True, **kw)
        spec = get_hybrid_stack_spec().submodules
        torch.manual_seed(0)
        if kind == "mamba":
            return MambaMixer(cfg, spec.mamba_layer.submodules.mixer.submodules, d_model=512)
        return GatedDeltaNet(cfg, spec.gdn_layer.submodules.self_attention.submodules)

    ref = build()
    fast = build(bf16=True, params_dtype=torch.bfloat16)
    fast.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    fast = fast.cuda()
    x = torch.randn(256, 2, 512)
    expected, _ = ref(x)
    got, _ = fast(x.cuda().bfloat16())
    assert _rel_err(got.cpu(), expected) < 3e-2


@pytest.mark.parametrize("kind", ["mamba", "gdn"])
def test_packed_documents_bf16_cuda_match_each_document_alone(kind):
    """Packed sequences on CUDA (the Triton scan where installed): a row of 4 documents gives each document
    the mixer output it gets alone, within bf16 noise (the CPU test proves the fp32 equality)."""
    from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.fixtures.tiny_gpt import single_rank
    single_rank()
    cfg = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8, hidden_dropout=0.0,
                            attention_dropout=0.0, normalization="RMSNorm", add_bias_linear=False,
                            mamba_state_dim=64, mamba_head_dim=64, mamba_num_groups=2, linear_key_head_dim=64,
                            linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                            bf16=True, params_dtype=torch.bfloat16)
    spec = get_hybrid_stack_spec().submodules
    torch.manual_seed(0)
    mixer = (MambaMixer(cfg, spec.mamba_layer.submodules.mixer.submodules, d_model=512) if kind == "mamba"
             else GatedDeltaNet(cfg, spec.gdn_layer.submodules.self_attention.submodules)).cuda()
    lengths = [100, 37, 300, 75]
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lengths), 0).tolist(), dtype=torch.int32, device="cuda")
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    x = torch.randn(sum(lengths), 1, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got, _ = mixer(x, packed_seq_params=packed)
        alone = torch.cat([mixer(part)[0] for part in torch.split(x, lengths)], dim=0)
    assert _rel_err(got, alone) < 3e-2
