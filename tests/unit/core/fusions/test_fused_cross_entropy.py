"""The fused cross entropy agrees with the eager vocab-parallel one on CPU (fp32 and bf16)."""
import pytest
import torch

from megatron.core.fusions import fused_cross_entropy as fce
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


def _ce_pair(dtype, chunk_elements=None, monkeypatch=None):
    torch.manual_seed(0)
    logits = (torch.randn(7, 3, 50) * 3).to(dtype)  # [s, b, V]
    target = torch.randint(0, 50, (7, 3))
    if chunk_elements is not None:
        monkeypatch.setattr(fce, "_CHUNK_ELEMENTS", chunk_elements)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    loss_fused = fce.fused_vocab_parallel_cross_entropy(a, target, tp_group=None)
    loss_ref = vocab_parallel_cross_entropy(b.float(), target, tp_group=None)
    g = torch.rand_like(loss_ref)
    (loss_fused * g).sum().backward()
    (loss_ref * g).sum().backward()
    return loss_fused, loss_ref, a.grad, b.grad


@pytest.mark.parametrize("chunk", [None, 50 * 4])  # one chunk; several chunks of 4 tokens (last one short)
def test_fused_cross_entropy_matches_eager_fp32(monkeypatch, chunk):
    lf, lr, gf, gr = _ce_pair(torch.float32, chunk, monkeypatch)
    assert lf.dtype == torch.float32 and lf.shape == (7, 3)
    torch.testing.assert_close(lf, lr, rtol=1e-6, atol=1e-6)  # same fp32 math, different op order
    torch.testing.assert_close(gf, gr, rtol=1e-6, atol=1e-6)


def test_fused_cross_entropy_bf16_keeps_dtype_and_matches(monkeypatch):
    lf, lr, gf, gr = _ce_pair(torch.bfloat16, 50 * 5, monkeypatch)
    torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-5)  # fp32 math on identical bf16 inputs
    assert gf.dtype == torch.bfloat16  # gradient written in the logits' dtype, no fp32 [s, b, V] grad
    torch.testing.assert_close(gf.float(), gr.float(), rtol=1e-2, atol=1e-3)  # one bf16 rounding
