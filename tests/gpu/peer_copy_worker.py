"""Run by tests/gpu/test_tp_comm_overlap_gpu.py under torchrun on 2 GPUs: the copy-engine TP transfers
(megatron/core/tensor_parallel/peer_copy.py) equal NCCL's all-gather / reduce-scatter and the plain GEMMs,
over many back-to-back operations (the two slots alternate, and a gathered tensor, which lives in its slot,
stays valid through the group's next operation) and a workspace that grows mid-way."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron.core.tensor_parallel import peer_copy  # noqa: E402

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
group, n, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
torch.backends.cuda.matmul.allow_tf32 = False
g = torch.Generator(device="cuda").manual_seed(1234 + r)


def gather(x):
    out = x.new_empty((n * x.size(0),) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def scatter(x):
    out = x.new_empty((x.size(0) // n,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


worst = 0.0
for step, m in enumerate([64, 64, 256, 64, 512, 512, 128]):  # 256 and 512 grow the workspace
    x = torch.randn(m, 2, 96, device="cuda", generator=g)
    w = torch.randn(96, 80, device="cuda", generator=g)
    out, total = peer_copy.all_gather_mm(x, w, group)
    ref_total = gather(x)
    assert torch.equal(total, ref_total), step
    worst = max(worst, (out - ref_total @ w).abs().max().item())
    big = torch.randn(n * m, 2, 96, device="cuda", generator=g)
    rs = peer_copy.mm_reduce_scatter(big, w, group)
    worst = max(worst, (rs - scatter(big @ w)).abs().max().item())
    total2, wait = peer_copy.all_gather_start(x, group)
    finish = peer_copy.reduce_scatter_start(big, group)  # started before the gather is waited on
    filler = big @ w  # work on the compute stream meanwhile
    wait()
    assert torch.equal(total2, ref_total), step
    worst = max(worst, (finish() - scatter(big)).abs().max().item())
    # The column linear's backward: the gather of X (its total used after the next operation started, as the
    # weight-gradient GEMM uses it), then the dX GEMM's reduce-scatter with the adds deferred past more work.
    total3, wait3 = peer_copy.all_gather_start(x, group)
    finish3 = peer_copy.mm_reduce_scatter_start(big, w, group)
    wait3()
    filler2 = total3.reshape(-1, 96).t() @ big[:n * m].reshape(-1, 96)
    assert torch.equal(total3, ref_total), step
    worst = max(worst, (finish3() - scatter(big @ w)).abs().max().item())
    del filler, filler2
torch.cuda.synchronize()
assert peer_copy.unavailable() is None, peer_copy.unavailable()
assert worst < 1e-3, worst  # fp32 sums of 2 terms in another order
print(f"peer copies ok, max abs difference {worst:.2e}", flush=True)
dist.destroy_process_group()
