"""The small-tensor path of ``fused_adamw.triton_adamw_step`` (torch's multi-tensor fused AdamW, then one
multi-tensor copy into the 16-bit model tensors) equals torch's own AdamW step and copy, clip factor
included; it runs on CPU too, so it is checked here (the Triton kernel's path is checked on CUDA in
tests/gpu/test_fast_path_gpu.py)."""
import torch

from megatron.core.optimizer.fused_adamw import SMALL_NUMEL, triton_adamw_step


def two_fused_adamws(init):
    """Two identical (params, torch fused AdamW) pairs over copies of ``init``: the first two tensors in a group
    at lr 3e-3 / weight decay 0.1, the rest at 1e-3 / 0; one steps as the reference, the other our way."""
    def make():
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        groups = [{"params": ps[:2], "lr": 3e-3, "weight_decay": 0.1},
                  {"params": ps[2:], "lr": 1e-3, "weight_decay": 0.0}]
        return ps, torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, fused=True)
    return make(), make()


def test_small_tensors_step_like_torch_fused_adamw():
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (48,), (5, 7)]
    assert all(torch.Size(s).numel() < SMALL_NUMEL for s in shapes)
    init = [torch.randn(s, generator=gen) for s in shapes]

    (ref_ps, ref), (ps, opt) = two_fused_adamws(init)
    copies = {p: torch.empty(p.numel(), dtype=torch.bfloat16) for p in ps}  # flat, as the model buffers
    copies[ps[1]] = None  # a main param that is its own model param: no copy
    for step in range(1, 4):
        grads = [torch.randn(s, generator=gen) * 5 for s in shapes]
        scale = torch.tensor(2.5) if step == 2 else None
        for p, q, g in zip(ref_ps, ps, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if scale is not None:
            ref.grad_scale = scale
        ref.step()
        if scale is not None:
            del ref.grad_scale
        triton_adamw_step(opt, copies, scale)
    for p, q in zip(ref_ps, ps):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
        torch.testing.assert_close(opt.state[q]["exp_avg_sq"], ref.state[p]["exp_avg_sq"], rtol=0, atol=0)
        assert float(opt.state[q]["step"]) == 3.0
        if copies[q] is not None:
            assert torch.equal(copies[q], q.detach().bfloat16().flatten())
    assert not torch.equal(init[0], ps[0].detach())  # it stepped
