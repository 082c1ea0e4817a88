"""Attention-only timings for long context (forward + backward, ms, CUDA events; median of --iters).

    python tools/bench_long_context_attention.py documents [--seq 8192 --doc-len 1024]
        packed-document attention (FlexAttention + document block mask) vs the dense [b, 1, s, s] mask
        path (SDPA with a boolean mask) vs plain causal SDPA on the same tokens; checks packed == dense.
    torchrun --nproc-per-node 2 tools/bench_long_context_attention.py ring [--seq 32768 --comm p2p]
        context-parallel attention over the GPUs vs the same local blocks without communication: equal
        times mean the ring's send/recv is hidden behind attention. --trace DIR writes a Chrome trace
        per rank (NCCL send/recv kernels next to the flash kernels).

Shapes default to Llama-3-8B's attention (32 heads, 8 KV groups, head dim 128), bf16, batch 1. On CPU the
script runs at toy size (fp32) as a smoke test.
"""
import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.context_parallel import long_context_attention  # noqa: E402
from megatron.core.context_parallel.documents import document_attention  # noqa: E402
from megatron.core.context_parallel.utils import DocumentLayout  # noqa: E402


def _time(fn, iters, warmup=3):
    """Median ms of fn() (forward + backward inside)."""
    cuda = torch.cuda.is_available()
    times = []
    for i in range(warmup + iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            import time
            t0 = time.perf_counter()
        fn()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def _qkv(seq, heads, groups, dim, device, dtype, batch=1):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, seq, dim, device=device, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(batch, groups, seq, dim, device=device, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(batch, groups, seq, dim, device=device, dtype=dtype, generator=g).requires_grad_()
    return q, k, v


def _fwd_bwd(fn, q, k, v, dout):
    def run():
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        out.backward(dout)
        return out
    return run


def documents(a, device, dtype):
    q, k, v = _qkv(a.seq, a.heads, a.groups, a.dim, device, dtype)
    dout = torch.randn_like(q)
    starts = list(range(0, a.seq, a.doc_len)) + [a.seq]
    layout = DocumentLayout(torch.tensor(starts, device=device), 1, a.seq)
    scale = a.dim ** -0.5
    rep = a.heads // a.groups
    doc = layout.doc[0]
    dense = (doc[:, None] == doc[None, :]) & torch.ones(a.seq, a.seq, dtype=torch.bool, device=device).tril()

    def packed(q, k, v):
        return document_attention(q, k, v, scale, layout)

    def masked(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              attn_mask=dense[None, None], scale=scale)

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=True, scale=scale)

    err = (packed(q, k, v) - masked(q, k, v)).abs().max().item()
    t = {name: _time(_fwd_bwd(fn, q, k, v, dout), a.iters) for name, fn in
         (("packed documents (flex on CUDA)", packed), ("dense [b,1,s,s] mask (SDPA)", masked),
          ("plain causal (SDPA)", causal))}
    print(f"seq {a.seq}, {len(starts) - 1} documents of {a.doc_len} tokens, {a.heads} heads / {a.groups} KV "
          f"groups, head dim {a.dim}, {dtype}, device {device}; packed vs dense max abs diff {err:.2e}")
    for name, ms in t.items():
        print(f"  {name:<36} {ms:9.3f} ms fwd+bwd")
    vals = list(t.values())
    print(f"  dense / packed = {vals[1] / vals[0]:.2f}x; packed / causal = {vals[0] / vals[2]:.2f}")


def ring(a, device, dtype):
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    group = torch.distributed.group.WORLD
    cp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    local = a.seq // cp
    q, k, v = _qkv(local, a.heads, a.groups, a.dim, device, dtype)
    dout = torch.randn_like(q)
    scale = a.dim ** -0.5

    def cp_attn(q, k, v):  # long_context_attention takes [s, b, n, d]
        out = long_context_attention(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), scale, group, a.comm)
        return out.permute(1, 2, 0, 3)

    with_comm = _time(_fwd_bwd(cp_attn, q, k, v, dout), a.iters)
    torch.distributed.barrier()
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
        with torch.profiler.profile() as prof:
            for _ in range(3):
                _fwd_bwd(cp_attn, q, k, v, dout)()
            torch.cuda.synchronize() if device.type == "cuda" else None
        prof.export_chrome_trace(os.path.join(a.trace, f"ring_rank{rank}.json"))
    if rank == 0:
        print(f"CP={cp} ({a.comm}), seq {a.seq} ({local} per rank), {a.heads} heads / {a.groups} KV groups, "
              f"head dim {a.dim}, {dtype}: {with_comm:.3f} ms fwd+bwd per layer"
              + (f"; traces in {a.trace}" if a.trace else ""))
    if a.comm == "p2p":
        # The same blocks with every send/recv replaced by keeping the local tensor: compute alone.
        from megatron.core.context_parallel import ring as ring_module
        real_start = ring_module._Ring.start
        ring_module._Ring.start = lambda self, send, tag: (send, [])
        alone = _time(_fwd_bwd(cp_attn, q, k, v, dout), a.iters)
        ring_module._Ring.start = real_start
        if rank == 0:
            print(f"  same blocks without send/recv: {alone:.3f} ms -> exposed communication "
                  f"{max(with_comm - alone, 0):.3f} ms ({max(with_comm - alone, 0) / with_comm * 100:.1f}%)")
    if rank == 0:
        # The yardstick: one device running causal attention over the whole sequence. With the causal load
        # balance each CP rank does 1/CP of its work, so ideal CP time = full / CP.
        fq, fk, fv = _qkv(a.seq, a.heads, a.groups, a.dim, device, dtype)
        rep = a.heads // a.groups

        def full_causal(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=rep > 1)
        full = _time(_fwd_bwd(full_causal, fq, fk, fv, torch.randn_like(fq)), a.iters)
        print(f"  one device, whole sequence {a.seq}: {full:.3f} ms -> CP efficiency "
              f"{full / cp / with_comm * 100:.1f}% (full / CP / ring time)")
    torch.distributed.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["documents", "ring"])
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--comm", default="p2p", choices=["p2p", "allgather", "a2a"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--trace", default=None)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:  # toy size smoke test
        a.heads, a.groups, a.dim, a.iters = 4, 2, 16, 2
        a.doc_len = min(a.doc_len, 64)
    a.seq = a.seq or ((8192 if a.mode == "documents" else 32768) if cuda else 256)
    (documents if a.mode == "documents" else ring)(a, device, dtype)


if __name__ == "__main__":
    main()
