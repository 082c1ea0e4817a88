"""One GPU: the precision-aware optimizer's Triton step (16-bit moments, grads or master weights read and written in
their own dtypes) equals its CPU reference step (fp32 arithmetic, each tensor rounded to its dtype) within one unit
in the last place, and with every dtype fp32 equals torch's fused AdamW."""
import pytest
import torch

from megatron.core.optimizer.precision_aware_adam import PrecisionAwareAdamW

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ULP = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def _run(device, param_dtype, grad_dtype, moment_dtype, steps=4):
    torch.manual_seed(0)
    params = [torch.randn(1000, 129).to(param_dtype).to(device), torch.randn(777).to(param_dtype).to(device)]
    opt = PrecisionAwareAdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, exp_avg_dtype=moment_dtype,
                              exp_avg_sq_dtype=moment_dtype)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.decoupled_grad = (torch.randn(p.shape, generator=g) * 1e-3).to(grad_dtype).to(device)
        opt.step()
    return [(p.cpu(), opt.state[p]["exp_avg"].cpu(), opt.state[p]["exp_avg_sq"].cpu()) for p in params]


@pytest.mark.parametrize("param_dtype,grad_dtype,moment_dtype", [
    (torch.float32, torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32, torch.bfloat16)])
def test_triton_step_equals_the_cpu_reference(param_dtype, grad_dtype, moment_dtype):
    for (p, m, v), (rp, rm, rv) in zip(_run("cuda", param_dtype, grad_dtype, moment_dtype),
                                       _run("cpu", param_dtype, grad_dtype, moment_dtype)):
        assert p.dtype == param_dtype and m.dtype == v.dtype == moment_dtype
        torch.testing.assert_close(p.double(), rp.double(), rtol=4 * ULP[param_dtype], atol=1e-12)
        torch.testing.assert_close(m.double(), rm.double(), rtol=ULP[moment_dtype], atol=1e-30)
        torch.testing.assert_close(v.double(), rv.double(), rtol=ULP[moment_dtype], atol=1e-30)


def test_fp32_triton_step_equals_torch_fused_adamw():
    torch.manual_seed(0)
    a = [torch.randn(1000, 129, device="cuda"), torch.randn(777, device="cuda")]
    b = [t.clone() for t in a]
    ref = torch.optim.AdamW(a, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    ours = PrecisionAwareAdamW(b, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(4):
        g = torch.Generator(device="cuda").manual_seed(step)
        for x, y in zip(a, b):
            x.grad = torch.randn(x.shape, generator=g, device="cuda") * 1e-3
            y.grad = x.grad.clone()
        ref.step()
        ours.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=4 * ULP[torch.float32], atol=1e-12)
