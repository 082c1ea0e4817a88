"""FP8 linear on CUDA (_scaled_mm layouts and scales on the real kernels) against a bf16 reference."""
import pytest
import torch

from megatron.core.fp8 import fp8_linear

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 GEMMs need CUDA compute capability >= 8.9")


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_fp8_linear_cuda_matches_bf16(fmt):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 2, 512, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(1024, 512, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    b = torch.zeros(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 2, 1024, device="cuda", generator=g).bfloat16()
    ref = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    y_ref = torch.nn.functional.linear(*ref)
    y_ref.backward(dy)
    y = fp8_linear(x, w, b, fmt=fmt)
    y.backward(dy)

    def rel(a, r):
        return ((a.float() - r.float()).norm() / r.float().norm()).item()
    assert rel(y, y_ref) < 0.06
    assert rel(x.grad, ref[0].grad) < 0.10 and rel(w.grad, ref[1].grad) < 0.10
    # main_grad path: fp32 wgrad output accumulated in place
    w2 = w.detach().clone().requires_grad_()
    w2.main_grad = torch.zeros(w2.shape, device="cuda", dtype=torch.float32)
    fp8_linear(x.detach(), w2, None, gradient_accumulation_fusion=True, fmt=fmt).backward(dy)
    assert rel(w2.main_grad, ref[1].grad) < 0.10
