"""The grouped experts' weight gradients straight into DDP's fp32 main_grad (megatron/core/fusions/grouped_wgrad.py):
the Triton kernel equals per-expert matmuls under Triton's CPU interpreter (its own process), and the grouped
experts' backward, with gradient_accumulation_fusion on a DDP-managed weight, writes the iteration's first
gradient, adds the next ones and hands autograd DDP's placeholder, so main_grad equals the plain autograd sum."""

import pytest
import torch

from megatron.core.fusions import grouped_wgrad
from megatron.core.transformer.moe.experts import grouped_gemm
from tests.unit.core.fusions.interpreted import check_worker, needs_triton3


@needs_triton3
def test_kernel_equals_per_expert_matmuls_under_the_interpreter():
    check_worker("grouped_wgrad_interpreted_worker.py", 2 * 3 * 2)


def _grouped_mm_on_cpu():
    try:
        torch._grouped_mm(torch.randn(4, 8), torch.randn(1, 8, 8), offs=torch.tensor([4], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        pytest.skip(f"_grouped_mm not available on CPU in this torch: {e}")


def test_fused_backward_writes_then_adds_into_main_grad():
    _grouped_mm_on_cpu()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.tensor([3, 0, 5])
    offs = torch.cumsum(tokens, 0).to(torch.int32)
    w = torch.randn(3, 8, 4, generator=gen, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_(True)
    # as DDP's zero_grad_buffer leaves a weight: main_grad "zeroed" (poisoned here, so a write shows), fresh
    w.main_grad = torch.full((3, 8, 4), float("nan"))
    w.grad_added_to_main_grad, w.main_grad_fresh = False, True
    for _ in range(2):  # two micro-batches: the first gradient is written, the second added
        x = torch.randn(8, 4, generator=gen)
        g = torch.randn(8, 8, generator=gen)
        grouped_gemm(x, w, tokens, offs, fuse_wgrad=True).backward(g)
        grouped_gemm(x, w_ref, tokens, offs).backward(g)
        assert w.grad_added_to_main_grad and not w.main_grad_fresh  # autograd got DDP's placeholder
        w.grad = None
    torch.testing.assert_close(w.main_grad, w_ref.grad, rtol=1e-5, atol=1e-6)
    assert w_ref.grad[1].abs().sum() == 0 and w.main_grad[1].abs().sum() == 0  # the expert without tokens


def test_without_a_ddp_weight_or_fusion_autograd_gets_the_gradient():
    _grouped_mm_on_cpu()
    tokens = torch.tensor([2, 2])
    offs = torch.cumsum(tokens, 0).to(torch.int32)
    for fuse, managed in ((True, False), (False, True)):
        w = torch.randn(2, 8, 4, requires_grad=True)
        if managed:
            w.main_grad, w.grad_added_to_main_grad = torch.zeros(2, 8, 4), False
        grouped_gemm(torch.randn(4, 4), w, tokens, offs, fuse_wgrad=fuse).sum().backward()
        assert w.grad is not None and w.grad.abs().sum() > 0
        if managed:
            assert w.main_grad.abs().sum() == 0  # DDP's hook, not the backward, adds it


def test_forced_way_is_checked(monkeypatch):
    monkeypatch.setenv("MEGATRON_GROUPED_WGRAD", "cutlass")
    with pytest.raises(ValueError, match="MEGATRON_GROUPED_WGRAD='cutlass'"):
        grouped_wgrad._choose(torch.zeros(1, 2, 2), torch.zeros(2, 2), torch.zeros(2, 2), None)
    monkeypatch.setenv("MEGATRON_GROUPED_WGRAD", "grouped_mm")
    assert grouped_wgrad._choose(torch.zeros(1, 2, 2), torch.zeros(2, 2), torch.zeros(2, 2), None)[0] == "grouped_mm"


def test_delayed_fused_wgrad_lands_in_main_grad_at_the_flush():
    """--delay-wgrad-compute with the fused path: backward parks the GEMM, the flush adds it into main_grad and runs
    the grad hooks with DDP's placeholder (the hook here clears .grad, as DDP's does)."""
    _grouped_mm_on_cpu()
    from megatron.core.transformer.moe.delayed_wgrad import DelayedWgrad
    gen = torch.Generator().manual_seed(1)
    tokens = torch.tensor([4, 4])
    offs = torch.cumsum(tokens, 0).to(torch.int32)
    w = torch.nn.Parameter(torch.randn(2, 8, 4, generator=gen))
    w_ref = w.detach().clone().requires_grad_(True)
    w.main_grad, w.grad_added_to_main_grad, w.main_grad_fresh = torch.zeros(2, 8, 4), False, True
    seen = []

    def hook(p):
        seen.append(p.grad is not None and p.grad_added_to_main_grad)
        p.grad = None
    w.register_post_accumulate_grad_hook(hook)
    store = DelayedWgrad()
    x, g = torch.randn(8, 4, generator=gen), torch.randn(8, 8, generator=gen)
    grouped_gemm(x, w, tokens, offs, store, fuse_wgrad=True).backward(g)
    assert store.pending and w.main_grad.abs().sum() == 0
    store.flush()
    grouped_gemm(x, w_ref, tokens, offs).backward(g)
    assert seen[-1] is True and w.grad is None  # (autograd's empty visit in backward came first: DDP skips it)
    torch.testing.assert_close(w.main_grad, w_ref.grad, rtol=1e-5, atol=1e-6)
