"""Muon: one update equals a float64 reference step; Megatron's param split, scale modes and QKV split."""
import math

import pytest
import torch

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
    (dict(muon_scalar_optimizer="lion"), "--muon-scalar-optimizer lion is not supported"),
    (dict(muon_coefficient_type="custom"), "--muon-coefficient-type custom"),
    (dict(muon_num_ns_steps=0), "--muon-num-ns-steps must be >= 1"),
])
def test_invalid_config_one_line(kwargs, needle):
    with pytest.raises(ValueError) as e:
        OptimizerConfig(optimizer="muon", lr=1e-3, **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)
