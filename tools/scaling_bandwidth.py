"""Bus bandwidth of the collectives the scaling model needs, measured on the machine it runs on.

    torchrun --nproc-per-node 2 tools/scaling_model.py measure-bandwidth --out bw.json [--sizes-mb 1 16 64 256]

Each of all-reduce, all-gather, reduce-scatter, all-to-all and p2p (rank pairs 0<->1, 2<->3, ... sending to each
other at once) runs on every size: warm-up calls, then timed calls back to back (CUDA events on GPUs, the host
clock on CPU), the median kept. Bus bandwidth follows nccl-tests' convention, so one number per link speed holds
for any group size: algbw = size / time and busbw = algbw x 2(n-1)/n (all-reduce), (n-1)/n (all-gather,
reduce-scatter, all-to-all), 1 (p2p, per direction). ``size`` is the full tensor (all-gather's output,
reduce-scatter's input). NCCL on GPUs, gloo on CPU (for tests; its numbers say nothing about a GPU machine).
"""
import json
import os
import statistics
import time
import warnings
from typing import Dict, List

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for an op on n ranks (nccl-tests' convention)."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _runner(op: str, nbytes: int, device):
    """A zero-argument callable running ``op`` once on a ``nbytes`` tensor (the full size, see the docstring)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # gloo reduces fp32 everywhere
    numel = max(n, nbytes // dtype.itemsize) // n * n
    full = torch.ones(numel, dtype=dtype, device=device)
    shard = torch.ones(numel // n, dtype=dtype, device=device)
    nbytes = numel * dtype.itemsize
    if op == "all_reduce":
        return (lambda: dist.all_reduce(full)), nbytes
    if op == "all_gather":
        return (lambda: dist.all_gather_into_tensor(full, shard)), nbytes
    if op == "reduce_scatter":
        if dist.get_backend() == "gloo":  # gloo has no reduce_scatter_tensor: the same bytes through all-reduce
            return (lambda: dist.all_reduce(full)), nbytes
        return (lambda: dist.reduce_scatter_tensor(shard, full)), nbytes
    if op == "all_to_all":
        out = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(out, full)), nbytes
    peer = rank ^ 1
    recv = torch.empty_like(full)
    if peer >= n:  # odd world size: the last rank sits out
        return (lambda: None), nbytes
    return (lambda: [w.wait() for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, full, peer),
                                                                dist.P2POp(dist.irecv, recv, peer)])]), nbytes


def _time_ms(fn, warmup: int, iters: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    # The slowest rank defines the collective's time.
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def measure(sizes_bytes: List[int], ops=OPS, warmup: int = 3, iters: int = 10) -> Dict:
    """Every rank calls this inside an initialised process group; every rank returns the same table."""
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    n = dist.get_world_size()
    table = {}
    for op in ops:
        rows = []
        for nbytes in sizes_bytes:
            fn, nbytes = _runner(op, nbytes, device)
            ms = _time_ms(fn, warmup, iters, cuda)
            algbw = nbytes / (ms * 1e-3) / 1e9
            rows.append({"bytes": nbytes, "ms": ms, "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(op, n)})
        table[op] = rows
    name = torch.cuda.get_device_name() if cuda else "cpu"
    return {"device": name, "backend": dist.get_backend(), "world_size": n,
            "gpus_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", n)), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "ops": table}


def run(out: str, sizes_mb: List[float], warmup: int, iters: int) -> Dict:
    """The measure-bandwidth mode: joins (or starts, from torchrun's environment) the process group, measures,
    and writes ``out`` on rank 0."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed collectives: both names work
    started = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        started = True
    try:
        result = measure([int(mb * 2**20) for mb in sizes_mb], warmup=warmup, iters=iters)
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
            for op, rows in result["ops"].items():
                cells = ", ".join(f"{r['bytes'] / 2**20:g} MiB {r['busbw_GBps']:.1f}" for r in rows)
                print(f"{op:15s} busbw GB/s: {cells}", flush=True)
        return result
    finally:
        if started:
            dist.destroy_process_group()
