"""Gradient clipping folded into the fused AdamW kernel (`grad_scale`) equals Megatron's explicit clip.

torch's fused AdamW also runs on CPU, so the folded path, which every CUDA run takes, is checked here
against the in-place multiply and against the unfused optimizer.
"""
import pytest
import torch

from megatron.core.optimizer import Float16OptimizerWithFloat16Params, OptimizerConfig
from tests.fixtures.tiny_gpt import single_rank


def _run(fused, fold, grad_scale_factor, steps=3):
    single_rank()  # the grad-norm reduction needs a (one-rank) process group
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).bfloat16()
    params = list(model.parameters())
    inner = torch.optim.AdamW([{"params": params}], lr=1e-2, weight_decay=0.1, fused=fused,
                              **({} if fused else {"foreach": False}))
    opt = Float16OptimizerWithFloat16Params(inner, OptimizerConfig(lr=1e-2, clip_grad=1.0, bf16=True))
    if not fold:
        opt._inner_step_unscales_grads = lambda: False
    assert opt._inner_step_unscales_grads() == (fused and fold)
    gen = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * grad_scale_factor).bfloat16()
        ok, norm, _ = opt.step()
        assert ok
        norms.append(float(norm))
    return [p.detach().float().clone() for p in opt.get_parameters()], norms


@pytest.mark.parametrize("grad_scale_factor", [10.0, 1e-3])  # clip active / inactive
def test_folded_clip_matches_explicit_clip(grad_scale_factor):
    folded, norms_f = _run(fused=True, fold=True, grad_scale_factor=grad_scale_factor)
    explicit, norms_e = _run(fused=True, fold=False, grad_scale_factor=grad_scale_factor)
    reference, norms_r = _run(fused=False, fold=False, grad_scale_factor=grad_scale_factor)
    assert norms_f == pytest.approx(norms_e, rel=1e-6) and norms_e == pytest.approx(norms_r, rel=1e-6)
    assert (max(norms_f) > 1.0) == (grad_scale_factor > 1)
    for a, b, c in zip(folded, explicit, reference):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(b, c, rtol=1e-6, atol=1e-7)
