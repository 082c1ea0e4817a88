"""Muon: one update equals a float64 reference step; Megatron's param split, scale modes and QKV split; the
batched Newton-Schulz over same-shaped matrices equals one matrix at a time."""
import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.layer_wise_optimizer import qkv_split_shapes, uses_muon
from megatron.core.optimizer.muon import NS_COEFFICIENTS, TensorParallelMuon, muon_scale_factor, newton_schulz
from tests.fixtures.tiny_gpt import cpu_reference_config, short_batch, short_gpt, single_rank


def ns64(x, steps=5, coefficients="quintic"):
    """Newton-Schulz in float64, written from the formula (Frobenius normalisation, wide orientation)."""
    x = x.double()
    t = x.shape[0] > x.shape[1]
    X = x.T if t else x
    X = X / max(X.norm().item(), 1e-7)
    sets = NS_COEFFICIENTS[coefficients]
    for i in range(steps):
        a, b, c = sets[i % len(sets)]
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if t else X


def reference_step(w, g, buf, lr, wd, momentum, nesterov, scale, split=None):
    """One Muon step in float64: decoupled decay, EMA momentum, (nesterov) update, scaled NS."""
    w, g, buf = w.double(), g.double(), buf.double()
    w = w * (1 - lr * wd)
    buf = buf + (1 - momentum) * (g - buf)
    u = g + momentum * (buf - g) if nesterov else buf
    if split is None:
        o = ns64(u) * muon_scale_factor(*u.shape, scale)
    else:
        groups = u.shape[0] // sum(split)
        parts = torch.split(u.view(groups, sum(split), -1), split, dim=1)
        outs = []
        for part in parts:
            m = part.reshape(-1, u.shape[1])
            outs.append((ns64(m) * muon_scale_factor(*m.shape, scale)).view(groups, -1, u.shape[1]))
        o = torch.cat(outs, dim=1).view_as(u)
    return w - lr * o, buf


@pytest.mark.parametrize("shape", [(24, 16), (16, 40)])
def test_newton_schulz_matches_float64(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    out = newton_schulz(x, 5)
    ref = ns64(x)
    # fp32 matmuls on O(1) entries over 5 iterations: ~1e-6 absolute.
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)
    # The quintic coefficients leave singular values in roughly [0.7, 1.2], not exactly 1.
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.6 and s.max() < 1.3


def test_bf16_newton_schulz_is_close():
    x = torch.randn(32, 24, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(newton_schulz(x, 5, bf16=True).double(), ns64(x), rtol=0, atol=5e-2)


@pytest.mark.parametrize("nesterov,scale", [(False, "spectral"), (True, "unit_rms_norm"), (True, "shape_scaling")])
def test_update_equals_float64_reference(nesterov, scale):
    g = torch.Generator().manual_seed(2)
    w0 = torch.randn(24, 16, generator=g)
    p = torch.nn.Parameter(w0.clone())
    opt = TensorParallelMuon([p], lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=0.1,
                             fp32_matmul_prec="high", scale_mode=scale, extra_scale_factor=1.0)
    w, buf = w0.double(), torch.zeros_like(w0).double()
    for _ in range(3):
        grad = torch.randn(24, 16, generator=g)
        p.grad = grad.clone()
        opt.step()
        w, buf = reference_step(w, grad, buf, 0.02, 0.1, 0.9, nesterov, scale)
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), buf, rtol=1e-6, atol=1e-7)


def test_qkv_split_equals_reference():
    """[q, k, v] rows per query group are orthogonalised as all-q, all-k, all-v matrices."""
    split = [4, 2, 2]
    g = torch.Generator().manual_seed(3)
    w0, grad = torch.randn(16, 12, generator=g), torch.randn(16, 12, generator=g)
    p = torch.nn.Parameter(w0.clone())
    p.is_qkv, p.qkv_split_shapes = True, split
    opt = TensorParallelMuon([p], lr=0.05, momentum=0.5, weight_decay=0.0, fp32_matmul_prec="high")
    p.grad = grad
    opt.step()
    ref, _ = reference_step(w0, grad, torch.zeros_like(w0), 0.05, 0.0, 0.5, False, "spectral", split)
    torch.testing.assert_close(p.detach().double(), ref, rtol=1e-5, atol=1e-6)
    unsplit, _ = reference_step(w0, grad, torch.zeros_like(w0), 0.05, 0.0, 0.5, False, "spectral")
    assert (p.detach().double() - unsplit).abs().max() > 1e-3  # the split changes the update


def test_scale_factors():
    assert muon_scale_factor(64, 16, "spectral") == 8.0
    assert muon_scale_factor(16, 64, "unit_rms_norm") == 0.5
    assert muon_scale_factor(16, 64, "shape_scaling") == 1.0 and muon_scale_factor(64, 16, "shape_scaling") == 2.0


def test_param_split_and_chained_step():
    """2-D hidden weights go to Muon; embeddings, the output layer, norms and biases to AdamW; both step."""
    single_rank()
    config = cpu_reference_config()
    model = short_gpt(config)
    names = {p: n for n, p in model.named_parameters()}
    muon = {n for p, n in names.items() if uses_muon(p)}
    assert muon == {n for n in names.values() if n.endswith(("linear_qkv.weight", "linear_proj.weight",
                                                            "linear_fc1.weight", "linear_fc2.weight"))
                    or n == "embedding.position_embeddings.weight"}
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1e-2, muon_fp32_matmul_prec="high"), [model])
    muon_opt, adam_opt = opt.chained_optimizers
    assert isinstance(muon_opt.optimizer, TensorParallelMuon) and isinstance(adam_opt.optimizer, torch.optim.AdamW)
    assert {names[p] for p in muon_opt.get_parameters()} == muon
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.is_qkv and qkv.qkv_split_shapes == qkv_split_shapes(config) == [16, 8, 8]
    tokens, pos = short_batch()
    before = {n: p.detach().clone() for p, n in names.items()}
    model(tokens, pos, None, labels=tokens).sum().backward()
    ok, norm, _ = opt.step()
    assert ok and math.isfinite(norm)
    assert all(not torch.equal(before[n], p.detach()) for p, n in names.items())


@pytest.mark.parametrize("kwargs,needle", [
    (dict(fp16=True), "--optimizer muon does not support --fp16"),
    (dict(muon_scale_mode="rms"), "--muon-scale-mode rms"),
    (dict(muon_tp_mode="x"), "--muon-tp-mode x"),
    (dict(muon_fp32_matmul_prec="low"), "--muon-fp32-matmul-prec low"),
    (dict(muon_scalar_optimizer="sgd"), "--muon-scalar-optimizer sgd is not supported; use adam or lion"),
    (dict(muon_coefficient_type="custom"), "--muon-coefficient-type custom"),
    (dict(muon_num_ns_steps=0), "--muon-num-ns-steps must be >= 1"),
])
def test_invalid_config_one_line(kwargs, needle):
    with pytest.raises(ValueError) as e:
        OptimizerConfig(optimizer="muon", lr=1e-3, **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_batched_newton_schulz_equals_one_matrix_at_a_time():
    """A [n, m, k] stack gives each matrix's 2-D result, wide and tall (transposed), fp32 and bf16."""
    g = torch.Generator().manual_seed(4)
    for shape in [(24, 40), (40, 24)]:
        xs = torch.randn(3, *shape, generator=g)
        for bf16 in (False, True):
            one = torch.stack([newton_schulz(x, 5, bf16=bf16) for x in xs])
            # bmm and mm may sum in other orders: fp32 ~1e-7 relative; in bf16 one rounding flip is ~4e-3 of an
            # entry (CPU gives equal bits here).
            tol = 1e-2 if bf16 else 1e-5
            assert ((newton_schulz(xs, 5, bf16=bf16) - one).norm() / one.norm()).item() < tol


def _shaped_params(seed):
    """Two of each: a fused QKV weight split [4, 2, 2] rows per group (k and v parts share a shape), square,
    tall (orthogonalised transposed) and wide weights, and one odd shape; 3 steps of grads."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in [(48, 16), (16, 16), (64, 16), (16, 64)] * 2 + [(40, 24)]:
        p = torch.nn.Parameter(torch.randn(*shape, generator=g))
        if shape == (48, 16):
            p.is_qkv, p.qkv_split_shapes = True, [4, 2, 2]
        params.append(p)
    return params, [[torch.randn(p.shape, generator=g) for p in params] for _ in range(3)]


def _run_muon(params, grads, **kwargs):
    """Updates (after - before) of 3 steps; two param groups with their own lr and weight decay."""
    before = [p.detach().clone() for p in params]
    groups = [{"params": params[:5], "lr": 0.02}, {"params": params[5:], "lr": 0.03, "weight_decay": 0.0}]
    opt = TensorParallelMuon(groups, lr=0.02, momentum=0.9, weight_decay=0.1, **kwargs)
    for step in grads:
        for p, grad in zip(params, step):
            p.grad = grad.clone()
        opt.step()
    return [p.detach() - b for p, b in zip(params, before)], opt


@pytest.mark.parametrize("prec", ["high", "medium"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_batched_step_equals_one_matrix_at_a_time(prec, nesterov):
    """The default step (stacks of same-shaped matrices, here also cut into stacks of <= 2 matrices) equals
    ns_batch_elements=0 (one matrix at a time): updates and momentum."""
    kwargs = dict(fp32_matmul_prec=prec, nesterov=nesterov)
    ref, ref_opt = _run_muon(*_shaped_params(5), ns_batch_elements=0, **kwargs)
    for budget in (2 ** 28, 2 * 64 * 16):
        params, grads = _shaped_params(5)
        out, opt = _run_muon(params, grads, ns_batch_elements=budget, **kwargs)
        for a, b in zip(out, ref):
            # Measured on CPU: fp32 equal bits at these shapes (~1e-7 relative at 128-512 rows); bf16 equal bits
            # or a rounding flip in the first cast of the momentum (~1e-5 of the update over 3 steps).
            assert ((a - b).norm() / b.norm()).item() < (1e-3 if prec == "medium" else 5e-6)
        for p, q in zip(params, ref_opt.state):
            assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm):
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_batched_step_launches_one_gemm_sequence_per_stack():
    """Llama-like layers (GQA QKV, proj, SwiGLU fc1, fc2) at 1/128 scale: 6 layers x 6 matrices x 15 GEMMs one
    at a time; stacked, q + proj (same shape), k + v, fc1 and fc2 are 4 stacks of 15 batched GEMMs."""
    def layers():
        params = []
        for _ in range(6):
            qkv = torch.nn.Parameter(torch.randn(2 * (16 + 4 + 4), 32))  # 2 query groups of [q 16, k 4, v 4]
            qkv.is_qkv, qkv.qkv_split_shapes = True, [16, 4, 4]
            params += [qkv, torch.nn.Parameter(torch.randn(32, 32)), torch.nn.Parameter(torch.randn(224, 32)),
                       torch.nn.Parameter(torch.randn(32, 112))]
        for p in params:
            p.grad = torch.randn_like(p)
        return params

    counts = {}
    for budget in (0, 2 ** 28):
        with _CountMatmuls() as mode:
            TensorParallelMuon(layers(), ns_batch_elements=budget).step()
        counts[budget] = dict(mode.counts)
    assert counts == {0: {"mm": 6 * 6 * 5, "addmm": 6 * 6 * 10}, 2 ** 28: {"bmm": 4 * 5, "baddbmm": 4 * 10}}
