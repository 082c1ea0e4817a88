"""The TP linears of one transformer layer under sequence parallelism, forward + backward, with and without
--tp-comm-overlap, against the same GEMMs without any communication (the floor the overlap can reach).

    torchrun --nproc-per-node 2 tools/bench_tp_overlap.py [--seq 8192 --hidden 4096 --ffn 14336 --trace DIR]

Shapes default to Llama-3-8B (QKV 4096 -> 6144 with 8 KV groups, proj 4096 -> 4096, fc1 4096 -> 2 x 14336,
fc2 14336 -> 4096), batch 1, bf16, ``--layers`` of them forward then backward (the host queues a whole pass,
as in training). Prints median ms per layer (CUDA events) and the share of the exposed
communication the overlap hides: (plain - overlap) / (plain - GEMMs only). On CPU (gloo) it runs at toy
size in fp32 as a smoke test. --trace writes a Chrome trace per rank of the overlapped run.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.nccl_group_options import get_nccl_options  # noqa: E402
from megatron.core.tensor_parallel import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    peer_copy,  # noqa: E402
)
from tools.bench_long_context_attention import _time as _median_ms  # noqa: E402  (median ms, CUDA events)


def _layers(a, tp, dtype, device, overlap, group):
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True, tp_comm_overlap=overlap,
                              params_dtype=dtype)
    init = lambda w: torch.nn.init.normal_(w, std=0.02)
    qkv_out = a.hidden + 2 * a.hidden // a.heads * a.groups
    specs = [(ColumnParallelLinear, a.hidden, qkv_out), (RowParallelLinear, a.hidden, a.hidden),
             (ColumnParallelLinear, a.hidden, 2 * a.ffn), (RowParallelLinear, a.ffn, a.hidden)]
    layers = []
    for cls, i, o in specs:
        kw = dict(input_is_parallel=True) if cls is RowParallelLinear else {}
        layers.append(cls(i, o, config=cfg, init_method=init, bias=False, tp_group=group,
                          **kw).to(device))
    return layers


def _inputs(layers, a, tp, dtype, device):
    """(input, output grad) of each layer: column layers take [s/tp, b, h], row layers [s, b, in/tp]."""
    out = []
    for layer in layers:
        col = isinstance(layer, ColumnParallelLinear)
        x = torch.randn(a.seq // tp if col else a.seq, 1, layer.input_size if col else layer.input_size_per_partition,
                        device=device, dtype=dtype, requires_grad=True)
        y_shape = (a.seq, 1, layer.output_size_per_partition) if col else (a.seq // tp, 1, layer.output_size)
        out.append((x, torch.randn(y_shape, device=device, dtype=dtype)))
    return out


def _step(layers, inputs):
    """Every linear's forward, then one backward through all of them: as in training, the host queues a
    whole pass while the GPU works (one linear at a time, the GPU would wait for the host between them)."""
    outs = [layer(x)[0] for layer, (x, _) in zip(layers, inputs)]
    torch.autograd.backward(outs, [dy for _, dy in inputs])


def _gemms_only(layers, inputs, tp):
    """The same forward and backward GEMMs on full-sequence tensors, no communication."""
    outs, grads = [], []
    for layer, (x, dy) in zip(layers, inputs):
        col = isinstance(layer, ColumnParallelLinear)
        full_x = x.detach().repeat(tp, 1, 1) if col else x
        outs.append(F.linear(full_x, layer.weight))
        grads.append(dy if col else dy.repeat(tp, 1, 1))
    torch.autograd.backward(outs, grads)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--layers", type=int, default=4, help="layers timed together; times are per layer")
    p.add_argument("--trace", default=None)
    p.add_argument("--high-priority", action="store_true",
                   help="the TP communicator's stream at high priority (--high-priority-stream-groups tp)")
    p.add_argument("--max-ctas", type=int, default=None, help="NCCL max_ctas of the TP communicator")
    p.add_argument("--min-ctas", type=int, default=None, help="NCCL min_ctas of the TP communicator")
    p.add_argument("--ring", action="store_true", help="the overlap over the NCCL ring only (no copy engines)")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        device, dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))), torch.bfloat16
        torch.cuda.set_device(device)
    else:
        device, dtype = torch.device("cpu"), torch.float32
        a.seq, a.hidden, a.ffn, a.heads, a.groups, a.iters = 64, 64, 128, 4, 2, 3
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    tp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    group = torch.distributed.group.WORLD
    options = {k: v for k, v in (("max_ctas", a.max_ctas), ("min_ctas", a.min_ctas)) if v is not None}
    if a.high_priority:
        options["is_high_priority_stream"] = True
    if options and cuda:  # the TP communicator as initialize_model_parallel builds it from these options
        group = torch.distributed.new_group(list(range(tp)), pg_options=get_nccl_options("tp", {"tp": options}))
    res = {}
    if a.ring:
        peer_copy.disable("--ring")
    for name, overlap in (("plain", False), ("overlap", True), ("overlap NCCL ring", True)):
        if name == "overlap NCCL ring":
            if not cuda or peer_copy.unavailable():
                continue  # the overlap row above already ran the ring
            peer_copy.disable("the bench's NCCL ring row")
        layers = [lin for _ in range(a.layers) for lin in _layers(a, tp, dtype, device, overlap, group)]
        inputs = _inputs(layers, a, tp, dtype, device)
        res[name] = _median_ms(lambda: _step(layers, inputs), a.iters) / a.layers
        if name == "overlap":
            transport = "copy engines" if cuda and not peer_copy.unavailable() else "NCCL ring"
        if name == "plain":
            res["gemms only"] = _median_ms(lambda: _gemms_only(layers, inputs, tp), a.iters) / a.layers
        elif a.trace and name == "overlap":
            os.makedirs(a.trace, exist_ok=True)
            with torch.profiler.profile() as prof:
                _step(layers, inputs)
                if cuda:
                    torch.cuda.synchronize()
            prof.export_chrome_trace(os.path.join(a.trace, f"tp_overlap_rank{rank}.json"))
    if rank == 0:
        exposed = res["plain"] - res["gemms only"]
        hidden = (res["plain"] - min(v for k, v in res.items() if k.startswith("overlap"))) / exposed \
            if exposed > 0 else float("nan")
        print(f"overlap over {transport}; TP={tp} {options or 'default NCCL options'} "
              f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')} "
              f"seq {a.seq} hidden {a.hidden} ffn {a.ffn} {str(dtype)[6:]} on {device.type}: "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in res.items())
              + f"; best overlap hides {100 * hidden:.0f}%",
              flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
