"""Time the SSM scans, forward + backward in bf16 on one GPU, for every kernel available here:
the eager chunked references, mamba-ssm's Triton SSD (Mamba-2) and fla's chunked gated delta rule (fla's own where
it is right, and fla's kernels with the dq/dk/dw/dg backward step in PyTorch, "fla + torch dqkwg").

    python tools/bench_ssm.py                 # Nemotron-H-8B Mamba-2 and Qwen3-Next GDN shapes
    python tools/bench_ssm.py --seq 4096 --batch 2
    python tools/bench_ssm.py --skip-eager    # the kernels only

Shapes: Nemotron-H-8B's mixer (hidden 4096 -> 128 heads of 64, state 128, 8 groups, seq 8192) and
Qwen3-Next-80B-A3B's Gated DeltaNet (16 key heads / 32 value heads of 128, seq 8192), batch 1.
Prints the median ms of one forward + backward of the scan alone (projections and conv not included).
"""
import argparse
import importlib

import torch
import torch.nn.functional as F

from megatron.core.ssm.ops.gated_delta_reference import chunk_gated_delta_rule_torch
from megatron.core.ssm.ops.kernels import _fla_unsafe_here, load_mamba_ssm_triton
from megatron.core.ssm.ops.ssd_reference import ssd_chunk_scan_torch


def _time(fn, make_inputs, iters=10, warmup=3):
    """Median ms of fn(*inputs) forward + backward (of the squared output's sum)."""
    times = []
    for i in range(warmup + iters):
        leaves = [t.detach().clone().requires_grad_() for t in make_inputs()]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).sum().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def mamba_inputs(batch, seq, heads=128, head_dim=64, groups=8, state=128):
    def make():
        x = torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        dt = F.softplus(torch.randn(batch, seq, heads, device="cuda") - 2)
        A = -torch.rand(heads, device="cuda") * 4 - 0.5
        B = torch.randn(batch, seq, groups, state, device="cuda", dtype=torch.bfloat16)
        C = torch.randn(batch, seq, groups, state, device="cuda", dtype=torch.bfloat16)
        D = torch.ones(heads, device="cuda")
        return x, dt, A, B, C, D
    return make


def gdn_inputs(batch, seq, key_heads=16, value_heads=32, dk=128, dv=128):
    def make():
        q = F.normalize(torch.randn(batch, seq, value_heads, dk, device="cuda"), dim=-1).bfloat16()
        k = F.normalize(torch.randn(batch, seq, value_heads, dk, device="cuda"), dim=-1).bfloat16()
        v = torch.randn(batch, seq, value_heads, dv, device="cuda", dtype=torch.bfloat16)
        g = F.logsigmoid(torch.randn(batch, seq, value_heads, device="cuda"))
        beta = torch.rand(batch, seq, value_heads, device="cuda", dtype=torch.bfloat16)
        return q, k, v, g, beta
    return make


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=128, help="SSD chunk size (Megatron's default 128)")
    parser.add_argument("--skip-eager", action="store_true", help="skip the eager references (slow, memory hungry)")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  batch {args.batch}  seq {args.seq}")

    ssd = {}
    module = load_mamba_ssm_triton()
    if module is not None:
        ssd["mamba-ssm triton"] = module.mamba_chunk_scan_combined
    if not args.skip_eager:
        ssd["eager chunked"] = ssd_chunk_scan_torch
    make = mamba_inputs(args.batch, args.seq)
    for name, kernel in ssd.items():
        ms = _time(lambda x, dt, A, B, C, D, k=kernel: k(x, dt, A, B, C, args.chunk, D=D), make)
        print(f"Mamba-2 SSD (Nemotron-H-8B: 128 heads x 64, state 128, 8 groups)  {name:18s} {ms:9.2f} ms fwd+bwd")
    # fla's kernels: not on Hopper with Triton 3.4.0-3.7.0 (their backward is wrong there; kernels.py says why)
    unsafe = _fla_unsafe_here(torch.device("cuda"))
    fla = {}
    if unsafe:
        print(f"fla's own kernels not timed: {unsafe}")
    else:
        for module, name in (("fla.ops.simple_gla", "chunk_simple_gla"),
                             ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")):
            try:
                fla[name] = getattr(importlib.import_module(module), name)
            except ImportError as e:
                print(f"fla not importable: {e}")
    if "chunk_simple_gla" in fla:  # the same recurrence: q = C, k = B, v = x dt, log decay A dt, + D x
        def fla_ssd(x, dt, A, B, C, D):
            rep = x.shape[2] // B.shape[2]
            q, k = C.repeat_interleave(rep, dim=2), B.repeat_interleave(rep, dim=2)
            o, _ = fla["chunk_simple_gla"](q, k, (x * dt.unsqueeze(-1)).to(x.dtype), g=A * dt, scale=1.0)
            return o + x * D[:, None].to(x.dtype)
        ms = _time(fla_ssd, make)
        print(f"Mamba-2 SSD (Nemotron-H-8B: 128 heads x 64, state 128, 8 groups)  {'fla simple_gla':18s} {ms:9.2f} ms "
              "fwd+bwd (incl. the group expansion)")

    gdn = {}
    if "chunk_gated_delta_rule" in fla:
        gdn["fla chunk"] = fla["chunk_gated_delta_rule"]
    # fla's kernels with the dq/dk/dw/dg backward step in PyTorch: what Hopper with Triton 3.4-3.7 runs
    try:
        composed = importlib.import_module("megatron.core.ssm.ops._fla_gated_delta")
        why_not = composed.unsupported_reason()
    except ImportError as e:
        composed, why_not = None, f"fla not importable: {e}"
    if why_not:
        print(f"fla + torch dqkwg not timed: {why_not}")
    else:
        gdn["fla + torch dqkwg"] = composed.chunk_gated_delta_rule_torch_dqkwg
    if not args.skip_eager:
        gdn["eager chunked"] = chunk_gated_delta_rule_torch
    make = gdn_inputs(args.batch, args.seq)
    for name, kernel in gdn.items():
        ms = _time(lambda q, k, v, g, beta, fn=kernel: fn(q, k, v, g, beta), make)
        print(f"Gated DeltaNet (Qwen3-Next: 32 value heads x 128, 16 key heads)     {name:18s} {ms:9.2f} ms fwd+bwd")


if __name__ == "__main__":
    main()
