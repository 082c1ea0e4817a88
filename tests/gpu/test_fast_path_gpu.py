"""Fast-path pieces on CUDA agree with their eager versions (run on a GPU machine; skipped elsewhere)."""
import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_compiled_cross_entropy_matches_eager():
    from megatron.core.fusions import fused_cross_entropy as fce
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    logits = (torch.randn(512, 2, 4096, device="cuda") * 4).bfloat16()
    target = torch.randint(0, 4096, (512, 2), device="cuda")
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    lf = fce.fused_vocab_parallel_cross_entropy(a, target, tp_group=None)
    lr = vocab_parallel_cross_entropy(b.float(), target, tp_group=None)
    (lf.sum()).backward()
    (lr.sum()).backward()
    assert _rel(lf, lr) < 1e-5  # fp32 math on the same bf16 inputs
    assert a.grad.dtype == torch.bfloat16 and _rel(a.grad, b.grad) < 1e-2  # one bf16 rounding


def test_weight_grad_accumulation_bf16_matches_fp64():
    from megatron.core.tensor_parallel.weight_grad import _accumulate_weight_grad
    g = torch.randn(4096, 512, device="cuda").bfloat16()
    x = torch.randn(4096, 256, device="cuda").bfloat16()
    main = torch.randn(512, 256, device="cuda")
    ref = main.double() + g.double().t() @ x.double()
    _accumulate_weight_grad(main, g, x)
    assert main.dtype == torch.float32 and _rel(main, ref) < 1e-5  # fp32 accumulate, no bf16 output


@pytest.mark.parametrize("backend", ["flash", "fused", "unfused", "auto"])
def test_attention_backends_agree(backend):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    cfg = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8, attention_dropout=0.0,
                            attention_backend=backend)
    attn = DotProductAttention(cfg, 1, AttnMaskType.causal)
    q, k, v = (torch.randn(256, 2, 8, 64, device="cuda").bfloat16() for _ in range(3))
    ref = DotProductAttention(TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8,
                                                attention_dropout=0.0, attention_backend="unfused"),
                              1, AttnMaskType.causal)(q.double(), k.double(), v.double())
    assert _rel(attn(q, k, v), ref) < 1e-2


def test_compiled_layer_matches_eager():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_layer import compile_transformer_layers
    cfg = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0, params_dtype=torch.bfloat16, bf16=True)
    torch.manual_seed(0)
    models = [GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=512, max_sequence_length=128).cuda()
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    assert compile_transformer_layers(models[1]) == 2
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    pos = torch.arange(128, device="cuda").expand(2, 128)
    out = []
    for m in models:
        loss = m(ids, pos, None, labels=ids).mean()
        loss.backward()
        out.append((loss, torch.cat([p.grad.float().flatten() for p in m.parameters()])))
    assert _rel(out[1][0], out[0][0]) < 1e-3
    assert _rel(out[1][1], out[0][1]) < 3e-2  # bf16 grads, different fusion order


def test_compiled_layers_fused_wgrad_reaches_main_grad():
    """--torch-compile with fused weight-gradient accumulation (the default) under DDP: every parameter's
    main_grad equals the eager layers' (Llama-shaped, TP=1). The compiled layers' linears once added their
    weight gradient into main_grad as a side effect of the traced backward, which torch 2.11 dropped on
    CUDA: their main_grad stayed zero and they did not train."""
    import os

    import torch.nn.functional as F

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.fusions.compile import compile_transformer_layers
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from tests.parallel.dist_utils import free_port

    # An earlier in-process training run (tests/fixtures/tiny_gpt.run_pretrain) keeps its default group: use it.
    own_group = not torch.distributed.is_initialized()
    if own_group:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel()
        cfg = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=512, gated_linear_unit=True, activation_func=F.silu,
                                normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
                                attention_dropout=0.0, params_dtype=torch.bfloat16, bf16=True,
                                gradient_accumulation_fusion=True)
        torch.manual_seed(0)
        models = [GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=512,
                           max_sequence_length=128, position_embedding_type="rope").cuda() for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        assert compile_transformer_layers(models[1]) == 2
        ddp = [DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), m)
               for m in models]
        ids = torch.randint(0, 512, (2, 128), device="cuda")
        pos = torch.arange(128, device="cuda").expand(2, 128)
        grads = []
        for d in ddp:
            d.zero_grad_buffer()
            d(ids, pos, None, labels=ids).mean().backward()
            grads.append({n: p.main_grad.double() for n, p in d.module.named_parameters()})
        for name, ref in grads[0].items():
            assert ref.norm() > 0, name
            assert _rel(grads[1][name], ref) < 3e-2, name  # bf16 grads, different fusion order
    finally:
        ps.destroy_model_parallel()
        if own_group:
            torch.distributed.destroy_process_group()


def test_clip_folded_into_fused_adam_matches_explicit_clip():
    """Clipping through the fused AdamW's grad_scale equals scaling the grads first."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.fixtures.tiny_gpt import single_rank
    single_rank()  # the grad-norm all-reduce needs a (one-rank) process group
    results = []
    for fold in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).cuda().bfloat16()
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, bf16=True), [model])
        if not fold:
            opt._inner_step_unscales_grads = lambda: False
        assert opt._inner_step_unscales_grads() == fold
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn_like(p) * 10  # global norm >> 1: the clip is active
            ok, norm, _ = opt.step()
            assert ok and norm > 1.0
        results.append([p.detach().float().clone() for p in opt.get_parameters()])
    for a, b in zip(*results):
        assert _rel(a, b) < 1e-6


@pytest.mark.parametrize("small_numel", [0, 100_000, 1 << 22])
def test_triton_adamw_matches_torch_fused_adamw(small_numel, monkeypatch):
    """The Triton AdamW (which also writes the bf16 model copy and divides grads by the clip factor as it
    reads them) and torch's fused AdamW against the same AdamW in float64, over 3 steps with two groups:
    both within fp32 rounding of it (torch's kernel rounds its intermediates differently, so the two
    fp32 results are compared through the float64 one). ``small_numel``: every tensor through the Triton
    kernel, the largest only, or none (the multi-tensor path for small tensors)."""
    from megatron.core.optimizer import fused_adamw
    from megatron.core.optimizer.fused_adamw import triton_adamw_applies, triton_adamw_step
    from tests.unit.core.optimizer.test_fused_adamw_small import two_fused_adamws
    monkeypatch.setattr(fused_adamw, "SMALL_NUMEL", small_numel)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(3, 70001), (128,), (5, 7)]
    hyper = [(3e-3, 0.1), (3e-3, 0.1), (1e-3, 0.0)]  # (lr, weight decay) per param, by group
    init = [torch.randn(s, device="cuda", generator=gen) for s in shapes]

    (ref_ps, ref), (ps, opt) = two_fused_adamws(init)
    copies = {p: torch.empty(p.shape, device="cuda", dtype=torch.bfloat16) for p in ps}
    f64 = [[t.double(), torch.zeros_like(t, dtype=torch.float64), torch.zeros_like(t, dtype=torch.float64)]
           for t in init]
    for step in range(1, 4):
        grads = [torch.randn(s, device="cuda", generator=gen) * 5 for s in shapes]
        scale = torch.tensor(2.5, device="cuda") if step == 2 else None
        for p, q, g in zip(ref_ps, ps, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if scale is not None:
            ref.grad_scale = scale
        ref.step()
        if scale is not None:
            del ref.grad_scale
        assert triton_adamw_applies(opt)
        triton_adamw_step(opt, copies, scale)
        for (lr, wd), st, g in zip(hyper, f64, grads):
            g = g.double() / (2.5 if scale is not None else 1.0)
            st[0] = st[0] - lr * wd * st[0]
            st[1] = 0.9 * st[1] + 0.1 * g
            st[2] = 0.95 * st[2] + 0.05 * g * g
            denom = st[2].sqrt() / (1 - 0.95 ** step) ** 0.5 + 1e-8
            st[0] = st[0] - lr / (1 - 0.9 ** step) * st[1] / denom
    for p, q, st in zip(ref_ps, ps, f64):
        for ours, theirs, exact in ((q, p, st[0]), (opt.state[q]["exp_avg"], ref.state[p]["exp_avg"], st[1]),
                                    (opt.state[q]["exp_avg_sq"], ref.state[p]["exp_avg_sq"], st[2])):
            bound = 16 * 2.0 ** -24 * exact.abs().max().item()  # a few fp32 roundings of the largest term
            assert (ours.double() - exact).abs().max().item() <= bound
            assert (theirs.double() - exact).abs().max().item() <= bound  # the same bound holds for torch's
        assert float(opt.state[q]["step"]) == 3.0 and opt.state[q]["step"].is_cuda
        assert torch.equal(copies[q], q.detach().bfloat16())


def test_weight_grad_accumulation_uses_addmm_epilogue():
    from megatron.core.tensor_parallel import weight_grad
    g = torch.randn(1024, 256, device="cuda").bfloat16()
    x = torch.randn(1024, 128, device="cuda").bfloat16()
    main = torch.randn(256, 128, device="cuda")
    ref = main.double() + g.double().t() @ x.double()
    weight_grad._accumulate_weight_grad(main, g, x)
    assert weight_grad._ADDMM_OUT_DTYPE, "torch.addmm(out_dtype=float32, out=main_grad) is unavailable here"
    assert _rel(main, ref) < 1e-5


@pytest.mark.parametrize("name", ["swiglu", "gelu", "gelu_tanh"])
def test_fused_bias_activation_matches_eager(name):
    from megatron.core.fusions import fused_bias_activation as fba
    fn = {"swiglu": fba.bias_swiglu, "gelu": fba.bias_gelu, "gelu_tanh": fba.bias_gelu_tanh}[name]
    x = torch.randn(256, 2, 1024, device="cuda").bfloat16().requires_grad_()
    bias = torch.randn(1024, device="cuda").bfloat16().requires_grad_()
    out = fn(x, bias)
    ref = fn.eager(x, bias)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, bias), g)
    ref_grads = torch.autograd.grad(ref, (x, bias), g)
    assert _rel(out, ref) < 1e-2  # one bf16 rounding apart: fused keeps fp32 between ops
    for a, b in zip(grads, ref_grads):
        assert _rel(a, b) < 2e-2


def test_fused_rms_norm_matches_eager():
    from megatron.core.transformer.torch_norm import RMSNorm
    cfg = TransformerConfig(num_layers=1, hidden_size=1024, num_attention_heads=8, normalization="RMSNorm",
                            params_dtype=torch.bfloat16)
    norm = RMSNorm(cfg, 1024).cuda()
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(256, 2, 1024, device="cuda").bfloat16()
    fused = norm(x)
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype) * norm.weight
    assert _rel(fused, ref) < 1e-2


@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_rope_matches_eager(interleaved):
    """--apply-rope-fusion (Megatron's default) runs RoPE as one Triton kernel per direction; equal to the eager
    form within bf16 rounding (the fused kernel rounds once), forward and gradient, with pass-through channels."""
    from megatron.core.fusions import rope as fused_rope
    from megatron.core.models.common.embeddings import rope_utils
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, apply_rope_fusion=True,
                            rotary_interleaved=interleaved)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randn(512, 2, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    freqs = torch.randn(512, 1, 1, 96, device="cuda", generator=gen) * 3
    dout = torch.randn_like(t)
    outs = []
    for fused in (True, False):
        x = t.clone().requires_grad_()
        cfg.apply_rope_fusion = fused
        y = rope_utils.apply_rotary_pos_emb(x, freqs, config=cfg, mscale=1.3)
        y.backward(dout)
        outs.append((y.float(), x.grad.float()))
    for a, b in zip(*outs):
        assert (a - b).abs().max().item() <= 2e-2 * max(1.0, b.abs().max().item())
    assert fused_rope.available(t, freqs)


def test_rope_kernel_on_a_strided_query_is_no_slower_than_compiled():
    """The Llama-3-8B query as the fused QKV projection leaves it (a strided view, 32 heads of 128 among 48), seq
    8192: the Triton kernel against the torch.compile'd rotation it replaces, values within bf16 rounding, and the
    forward + backward in no more GPU time."""
    from megatron.core.fusions import rope as fused_rope
    from megatron.core.models.common.embeddings import rope_utils
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(8192, 1, 48, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    freqs = torch.randn(8192, 1, 1, 128, device="cuda", generator=gen)
    dout = torch.randn(8192, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    assert fused_rope.available(qkv[:, :, :32], freqs)

    def run(fn):
        x = qkv.clone().requires_grad_()
        y = fn(x[:, :, :32], freqs, 1.0, False)
        y.backward(dout)
        return y, x.grad

    got, want = run(fused_rope.rope), run(rope_utils._rope_compiled)
    for a, b in zip(got, want):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * max(1.0, b.float().abs().max().item())

    from tests.gpu.benchmark_runs import gpu_ms, kernel_profile
    (t_triton, _), (t_compiled, _) = kernel_profile(lambda: run(fused_rope.rope)), kernel_profile(
        lambda: run(rope_utils._rope_compiled))
    print(f"RoPE forward + backward: kernels Triton {t_triton:.3f} ms, compiled {t_compiled:.3f} ms (same clone and "
          f"gradient copies in both); wall {gpu_ms(lambda: run(fused_rope.rope)):.3f} vs "
          f"{gpu_ms(lambda: run(rope_utils._rope_compiled)):.3f} ms")
    assert t_triton <= t_compiled, (t_triton, t_compiled)


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_gqa_attention_matches_repeated_kv(causal):
    """GQA through cuDNN with K/V at their own head count equals attention over K/V repeated to every
    query head (fp64 reference), output and q/k/v gradients, within bf16 rounding; the path is taken."""
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer.enums import AttnMaskType
    cfg = TransformerConfig(num_layers=1, hidden_size=1024, num_attention_heads=8, num_query_groups=2,
                            attention_dropout=0.0)
    mask = AttnMaskType.causal if causal else AttnMaskType.no_mask
    attn = dpa.DotProductAttention(cfg, 1, mask)
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = [torch.randn(512, 2, n, 128, device="cuda", generator=gen).bfloat16().requires_grad_() for n in (8, 2, 2)]
    out = attn(*qkv)
    assert dpa._CUDNN_GQA["ok"] is True
    ref_in = [t.detach().double().requires_grad_() for t in qkv]
    q, k, v = (t.permute(1, 2, 0, 3) for t in ref_in)
    k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ref = ref.permute(2, 0, 1, 3).reshape(512, 2, 1024)
    dout = torch.randn(ref.shape, device="cuda", generator=gen, dtype=torch.float64)
    out.backward(dout.bfloat16())
    ref.backward(dout)
    assert _rel(out, ref) < 1e-2
    for a, b in zip(qkv, ref_in):
        assert _rel(a.grad, b.grad) < 2e-2


def test_main_grad_accumulation_kernel_equals_add():
    """The Triton accumulation into the fp32 DDP buffer is bitwise torch's mixed-dtype add_, also for a
    size that is not a multiple of the block, and it is the path taken; its overwrite writes the gradient."""
    from megatron.core.fusions import grad_accumulation as ga
    for dtype in (torch.bfloat16, torch.float16):
        main = torch.randn(3, 70001, device="cuda")
        grad = torch.randn(3, 70001, device="cuda").to(dtype)
        ref = main.clone().add_(grad)
        ga.accumulate_into_main_grad(main, grad)
        assert ga._triton_impl() and torch.equal(main, ref)
        ga.accumulate_into_main_grad(main, grad, overwrite=True)  # the first gradient on a zeroed buffer
        assert torch.equal(main, grad.float())


def test_fused_linear_wgrad_writes_then_adds():
    """The dense linears' fused weight gradient: the iteration's first GEMM writes main_grad (beta = 0, the
    buffer not read; torch's mm(out_dtype=, out=) is the path taken), later ones add in the epilogue."""
    from megatron.core.tensor_parallel import weight_grad as wg
    gen = torch.Generator(device="cuda").manual_seed(0)
    g = torch.randn(4096, 1024, device="cuda", generator=gen).bfloat16()
    x = torch.randn(4096, 2048, device="cuda", generator=gen).bfloat16()
    ref = g.float().t() @ x.float()
    main = torch.full((1024, 2048), float("nan"), device="cuda")  # a write shows: nothing of it is read
    wg._accumulate_weight_grad(main, g, x, overwrite=True)
    assert wg._MM_OUT_DTYPE and torch.isfinite(main).all()
    torch.testing.assert_close(main, ref, rtol=1e-3, atol=1e-2)
    wg._accumulate_weight_grad(main, g, x)
    torch.testing.assert_close(main, 2 * ref, rtol=1e-3, atol=2e-2)


def test_grouped_wgrad_into_main_grad_equals_grouped_mm_and_add(monkeypatch):
    """The Triton grouped weight gradient accumulated in fp32 (megatron/core/fusions/grouped_wgrad.py) equals
    torch._grouped_mm's bf16 gradient added into the fp32 buffer within bf16 rounding of that gradient, written
    and added, with an expert that gets no rows and rows that do not fill a tile; the automatic choice times
    both once and gives the same result."""
    from megatron.core.fusions import grouped_wgrad as gw
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([700, 0, 1300, 2048], device="cuda")
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = int(counts.sum())
    grad = torch.randn(rows, 2816, device="cuda", generator=gen).bfloat16()
    x = torch.randn(rows, 2048, device="cuda", generator=gen).bfloat16()
    base = torch.randn(4, 2816, 2048, device="cuda", generator=gen)
    ref = torch.stack([grad[s:e].float().t() @ x[s:e].float() for s, e in
                       zip([0] + offs[:-1].tolist(), offs.tolist())])
    assert gw.fused_available(base, grad, x)
    for way in ("fused", "grouped_mm", "auto"):
        monkeypatch.setenv("MEGATRON_GROUPED_WGRAD", way)
        for overwrite in (True, False):
            out = base.clone()
            gw.grouped_wgrad_into_main_grad(out, grad, x, offs, overwrite=overwrite)
            want = ref if overwrite else base + ref
            err = ((out - want).norm() / want.norm()).item()
            assert err < 5e-3, f"{way}, overwrite={overwrite}: relative error {err:.2e}"
    assert gw._CHOICE  # the automatic way timed both and kept one


def test_grouped_experts_fused_swiglu_matches_eager():
    """The compiled silu(gate) * up * prob of grouped experts equals the eager form within bf16 rounding,
    forward and gradients, for two token counts (one dynamic-shape graph) and without probs."""
    from megatron.core.transformer.moe import experts
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, with_probs in ((1000, True), (1777, True), (640, False)):
        h = torch.randn(n, 256, device="cuda", generator=gen).bfloat16()
        p = torch.rand(n, device="cuda", generator=gen) if with_probs else None
        outs = []
        for fn in (experts._fused_swiglu_scaled, experts._swiglu_scaled):
            x = h.clone().requires_grad_()
            pp = None if p is None else p.clone().requires_grad_()
            y = fn(x, pp)
            y.backward(torch.ones_like(y))
            outs.append((y.float(), x.grad.float()) + (() if pp is None else (pp.grad.float(),)))
        for a, b in zip(*outs):
            assert _rel(a, b) < 1e-2
    from megatron.core.fusions import swiglu
    assert swiglu._kernels()  # the Triton kernels ran, not a fallback


@pytest.mark.parametrize("shape", [(1000, 2816), (37, 11264), (5, 48), (0, 2816), (64, 3, 512)],
                         ids=["fine", "mixtral-rows", "unaligned", "empty", "3d"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
def test_triton_swiglu_matches_fp32_reference(shape, with_probs):
    """The Triton silu(gate) * up (* prob) against the same math in fp32 autograd on the same bf16 inputs:
    forward and input gradient within one bf16 rounding, the probabilities' gradient (an fp32 row sum)
    within fp32 summation order."""
    from megatron.core.fusions.swiglu import swiglu, swiglu_reference, triton_swiglu_available
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = (torch.randn(shape, device="cuda", generator=gen) * 3).bfloat16()
    assert triton_swiglu_available(h)
    p = torch.rand(shape[:-1], device="cuda", generator=gen) if with_probs else None
    g = torch.randn(*shape[:-1], shape[-1] // 2, device="cuda", generator=gen).bfloat16()
    x, xr = h.clone().requires_grad_(), h.float().requires_grad_()
    pp = None if p is None else p.clone().requires_grad_()
    pr = None if p is None else p.clone().requires_grad_()
    y = swiglu(x, pp)
    gate, up = torch.chunk(xr, 2, dim=-1)
    yr = torch.nn.functional.silu(gate) * up * (1.0 if pr is None else pr.unsqueeze(-1))
    y.backward(g)
    yr.backward(g.float())
    assert y.dtype == torch.bfloat16 and y.shape == yr.shape
    if h.numel() == 0:
        assert x.grad.shape == h.shape
        return
    torch.testing.assert_close(y, swiglu_reference(h, p), rtol=8e-3, atol=1e-6)  # one rounding of fp32 math
    torch.testing.assert_close(x.grad.float(), xr.grad, rtol=8e-3, atol=1e-5)
    if p is not None:
        torch.testing.assert_close(pp.grad, pr.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_fused_router_matches_eager(score_function):
    """--moe-router-fusion's compiled routing and balancing scores equal the eager functions on CUDA
    (the same selected experts; probabilities and their gradient within fp32 rounding), no fallback."""
    from megatron.core.transformer.moe import moe_utils
    route, scores = moe_utils.fused_router_fns()
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(8192, 64, device="cuda", generator=gen)
    bias = torch.randn(64, device="cuda", generator=gen) * 0.1 if score_function == "sigmoid" else None
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    probs, routing_map = route(a, 6, score_function=score_function, expert_bias=bias)
    ref_probs, ref_map = moe_utils.topk_routing_with_score_function(b, 6, score_function=score_function,
                                                                    expert_bias=bias)
    assert torch.equal(routing_map, ref_map)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-6)
    probs.pow(2).sum().backward()
    ref_probs.pow(2).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    m, s = scores(logits, 6, score_function)
    rm, rs = moe_utils.compute_routing_scores_for_aux_loss(logits, 6, score_function)
    assert torch.equal(m, rm)
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=1e-6)
    assert route.state["fn"] is not moe_utils.topk_routing_with_score_function  # compiled, no fallback


def test_fused_bias_dropout_add_matches_eager():
    """--bias-dropout-fusion's training bda with a bias is one compiled kernel on CUDA: its values and gradients
    are as close to the fp32 result as the eager expression's. The compiled kernel rounds once where eager rounds
    after the bias add too, so the two differ by bf16 rounding, which the bias gradient (a sum over 1,576 rows
    with cancellation) amplifies past an element-wise tolerance: each is measured against fp32 instead."""
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train, bias_dropout_add_unfused
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (197, 8, 1024)
    x, residual = (torch.randn(shape, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    bias = torch.randn(1024, device="cuda", generator=gen).bfloat16().requires_grad_()
    ref_out = x.detach().double() + bias.detach().double() + residual.detach().double()
    ref = (ref_out, 2 * ref_out, 2 * ref_out.sum((0, 1)), 2 * ref_out)  # out, d/dx, d/dbias, d/dresidual
    errors = []
    for fn in (bias_dropout_add_fused_train, bias_dropout_add_unfused(True)):
        out = fn((x, bias), residual, 0.0)
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        got = (out.detach(), x.grad, bias.grad, residual.grad)
        errors.append([((g.double() - r).norm() / r.norm()).item() for g, r in zip(got, ref)])
        x.grad = bias.grad = residual.grad = None
    fused, eager = errors
    for name, f, e in zip(("out", "x.grad", "bias.grad", "residual.grad"), fused, eager):
        assert f <= max(2 * e, 4e-3), f"{name}: fused relative error {f:.2e}, eager {e:.2e}"


def test_linear_bias_in_gemm_epilogue_matches_matmul_plus_bias():
    """A linear that adds its own bias does it in the GEMM (addmm) on CUDA: same output as matmul then add
    (bf16: one rounding fewer), same gradients."""
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(197, 4, 1024, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(3072, 1024, device="cuda", generator=gen) * 0.03).bfloat16().requires_grad_()
    b = torch.randn(3072, device="cuda", generator=gen).bfloat16().requires_grad_()
    outs = []
    for fn in (lambda: linear_with_grad_accumulation_and_async_allreduce(x, w, b), lambda: x @ w.t() + b):
        out = fn()
        out.float().square().mean().backward()
        outs.append((out.detach().float(), x.grad.float(), w.grad.float(), b.grad.float()))
        x.grad = w.grad = b.grad = None
    assert outs[0][0].shape == (197, 4, 3072)
    for a, ref in zip(*outs):
        torch.testing.assert_close(a, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_attention_sinks_on_cuda_match_fp64(softmax_type):
    """--softmax-type on CUDA in bf16 (torch's masked SDPA kernel over the sink-augmented keys): the output and the
    sink's gradient against the fp64 formula, GQA 8/2 heads of 64 (gpt-oss's head dim), seq 1024."""
    from megatron.core.transformer.attention_sinks import reference_sink_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    cfg = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2, kv_channels=64,
                            attention_dropout=0.0, softmax_type=softmax_type, bf16=True, params_dtype=torch.bfloat16)
    core = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    s, b = 1024, 2
    q = torch.randn(s, b, 8, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(s, b, 2, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
    out = core(q, k, v, None).view(s, b, 8, 64).permute(1, 2, 0, 3)
    kr, vr = (t.permute(1, 2, 0, 3).repeat_interleave(4, dim=1) for t in (k, v))
    sink = core.softmax_offset
    ref = reference_sink_attention(q.permute(1, 2, 0, 3), kr, vr, sink, 64 ** -0.5,
                                   torch.ones(s, s, dtype=torch.bool, device="cuda").tril())
    assert (out.double() - ref).abs().max().item() < 2e-2
    if softmax_type == "learnable":
        dy = torch.randn_like(out)
        got = torch.autograd.grad(out, sink, dy)[0].double()
        want = torch.autograd.grad(ref, sink, dy.double())[0].double()
        assert (got - want).abs().max().item() <= 2e-2 * max(1.0, want.abs().max().item())
