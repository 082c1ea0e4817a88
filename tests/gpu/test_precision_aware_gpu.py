"""One GPU: the precision-aware optimizer's Triton step (16-bit moments, grads or master weights read and written in
their own dtypes) equals its CPU reference step (fp32 arithmetic, each tensor rounded to its dtype), and with every
dtype fp32 tracks torch's fused AdamW.

Each step is compared from one state: the GPU's state before the step is copied to the CPU and stepped there. Two fp32
implementations differ in the last bits (the kernel's bias corrections are fp32 powers, torch's are float64), so a
16-bit moment may round one unit the other way; over several steps such flips compound into differences of 1% of an
update, which says nothing about either. From one state the bound is tight: moments within one unit in the last place
of their dtype, the param within two units of its dtype plus 1e-5 of the step size (a wrong cast, bias correction or
weight decay is off by far more)."""
import pytest
import torch

from megatron.core.optimizer.precision_aware_adam import PrecisionAwareAdamW, _reference_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ULP = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
LR, BETAS, WD, EPS = 1e-2, (0.9, 0.95), 0.1, 1e-8


@pytest.mark.parametrize("param_dtype,grad_dtype,moment_dtype", [
    (torch.float32, torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32, torch.bfloat16), (torch.float32, torch.float32, torch.float32)])
def test_triton_step_equals_the_cpu_reference_step_by_step(param_dtype, grad_dtype, moment_dtype):
    torch.manual_seed(0)
    params = [torch.randn(1000, 129).to(param_dtype).cuda(), torch.randn(777).to(param_dtype).cuda()]
    opt = PrecisionAwareAdamW(params, lr=LR, betas=BETAS, weight_decay=WD, eps=EPS, exp_avg_dtype=moment_dtype,
                              exp_avg_sq_dtype=moment_dtype)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        before = []
        for p in params:
            p.decoupled_grad = (torch.randn(p.shape, generator=g) * 1e-3).to(grad_dtype).cuda()
            state = opt.state[p]
            m, v = (state[k].cpu().clone() if state else torch.zeros(p.shape, dtype=moment_dtype)
                    for k in ("exp_avg", "exp_avg_sq"))
            before.append((p.cpu().clone(), p.decoupled_grad.cpu(), m, v, m.clone(), v.clone(),
                           float(state["step"]) if state else 0.0))
        opt.step()
        for p, (rp, rg, rm, rv, m_before, v_before, count) in zip(params, before):
            _reference_step(rp, rg, rm, rv, count + 1, LR, *BETAS, EPS, WD)
            state = opt.state[p]
            assert float(state["step"]) == count + 1
            assert p.dtype == param_dtype and state["exp_avg"].dtype == state["exp_avg_sq"].dtype == moment_dtype
            step_size = LR / (1 - BETAS[0] ** (count + 1))
            torch.testing.assert_close(p.cpu().double(), rp.double(), rtol=2 * ULP[param_dtype], atol=1e-5 * step_size)
            # fp32 rounding differences scale with the update's terms, not its result (beta1 * m and (1 - beta1) * g
            # may cancel): four fp32 units of the terms, plus one unit of the stored dtype
            g32 = rg.double().abs()
            _within(state["exp_avg"], rm, moment_dtype, BETAS[0] * m_before.double().abs() + (1 - BETAS[0]) * g32)
            _within(state["exp_avg_sq"], rv, moment_dtype, BETAS[1] * v_before.double() + (1 - BETAS[1]) * g32 ** 2)


def _within(ours, ref, dtype, terms):
    diff = (ours.cpu().double() - ref.double()).abs()
    bound = ULP[dtype] * ref.double().abs() + 4 * ULP[torch.float32] * terms
    worst = int((diff - bound).argmax())
    assert bool((diff <= bound).all()), (f"{int((diff > bound).sum())} of {diff.numel()} elements off; worst at "
                                         f"{worst}: {ours.flatten()[worst].item()} vs {ref.flatten()[worst].item()}")


def test_fp32_triton_step_tracks_torch_fused_adamw():
    """Four fp32 steps against torch's fused AdamW: within 1e-5 of a step size (measured on H200: 2.6e-8 after four
    steps of 1e-2) and four units in the last place."""
    torch.manual_seed(0)
    a = [torch.randn(1000, 129, device="cuda"), torch.randn(777, device="cuda")]
    b = [t.clone() for t in a]
    ref = torch.optim.AdamW(a, lr=LR, betas=BETAS, weight_decay=WD, eps=EPS, fused=True)
    ours = PrecisionAwareAdamW(b, lr=LR, betas=BETAS, weight_decay=WD, eps=EPS)
    for step in range(4):
        g = torch.Generator(device="cuda").manual_seed(step)
        for x, y in zip(a, b):
            x.grad = torch.randn(x.shape, generator=g, device="cuda") * 1e-3
            y.grad = x.grad.clone()
        ref.step()
        ours.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=4 * ULP[torch.float32], atol=1e-5 * LR)
