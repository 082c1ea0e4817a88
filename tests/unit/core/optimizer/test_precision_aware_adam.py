"""PrecisionAwareAdamW (--use-precision-aware-optimizer's step): with fp32 moments it is torch's AdamW bit for bit;
with bf16 moments, bf16 grads (``decoupled_grad``) or fp16 main params it is the float64 AdamW step with each
tensor rounded to its dtype after every step; loading a state dict keeps the moments' dtypes."""
import math

import pytest
import torch

from megatron.core.optimizer.precision_aware_adam import PrecisionAwareAdamW

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8


def _params(dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(33, 7).to(dtype).requires_grad_(), torch.randn(5).to(dtype).requires_grad_()]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * 10 ** -(i + 2) for i, p in enumerate(params)]


def test_fp32_moments_are_torch_adamw_bit_for_bit():
    a, b = _params(), _params()
    groups = lambda ps: [{"params": [ps[0]], "weight_decay": WD}, {"params": [ps[1]], "weight_decay": 0.0}]  # noqa
    ref = torch.optim.AdamW(groups(a), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    ours = PrecisionAwareAdamW(groups(b), lr=LR, betas=BETAS, eps=EPS)
    for step in range(6):
        for x, y, g in zip(a, b, _grads(step, a)):
            x.grad, y.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for x, y in zip(a, b):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref.state[x][key], ours.state[y][key])


def _float64_reference(params, moment_dtype, grad_dtype, steps):
    """AdamW in float64; after each step every tensor is rounded to the dtype it is stored in."""
    p = [x.detach().double() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for step in range(steps):
        t = step + 1
        for i, g in enumerate(_grads(step, params)):
            g = g.to(grad_dtype).double()
            p[i] = p[i] * (1 - LR * WD)
            m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * g
            v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * g * g
            denom = v[i].sqrt() / math.sqrt(1 - BETAS[1] ** t) + EPS
            p[i] = p[i] - LR / (1 - BETAS[0] ** t) * m[i] / denom
            p[i] = p[i].to(params[i].dtype).double()
            m[i], v[i] = m[i].to(moment_dtype).double(), v[i].to(moment_dtype).double()
    return p, m, v


@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                    (torch.float16, torch.bfloat16)])
def test_16_bit_tensors_are_the_float64_step_rounded_to_their_dtypes(param_dtype, grad_dtype):
    params = _params(param_dtype)
    start = [p.detach().clone() for p in params]
    opt = PrecisionAwareAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, exp_avg_dtype=torch.bfloat16,
                              exp_avg_sq_dtype=torch.bfloat16)
    for step in range(5):
        for p, g in zip(params, _grads(step, params)):
            p.grad = None
            p.decoupled_grad = g.to(grad_dtype)  # the distributed optimizer's grad of another dtype
        opt.step()
    ref_p, ref_m, ref_v = _float64_reference(start, torch.bfloat16, grad_dtype, 5)
    for p, rp, rm, rv in zip(params, ref_p, ref_m, ref_v):
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and p.dtype == param_dtype
        # fp32 arithmetic against float64: a stored moment may differ by one unit in its last place, a param (whose
        # update rounds at each of its fp32 operations, over 5 steps) by a few.
        ulp = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
        torch.testing.assert_close(p.double(), rp, rtol=8 * ulp[param_dtype], atol=1e-12)
        torch.testing.assert_close(state["exp_avg"].double(), rm, rtol=ulp[torch.bfloat16], atol=1e-30)
        torch.testing.assert_close(state["exp_avg_sq"].double(), rv, rtol=ulp[torch.bfloat16], atol=1e-30)


def test_loaded_state_keeps_the_moment_dtypes():
    params = _params()
    opt = PrecisionAwareAdamW(params, lr=LR, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    opt.step()
    saved = opt.state_dict()
    again = PrecisionAwareAdamW(_params(), lr=LR, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    again.load_state_dict(saved)
    for p, q in zip(opt.param_groups[0]["params"], again.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert again.state[q][key].dtype == torch.bfloat16
            assert torch.equal(again.state[q][key], opt.state[p][key])


def test_unsupported_moment_dtype_is_refused():
    with pytest.raises(ValueError, match="exp_avg_sq_dtype torch.float16 is not one of fp32, bf16"):
        PrecisionAwareAdamW(_params(), exp_avg_sq_dtype=torch.float16)
