"""The grouped expert GEMMs of the MoE benchmark shapes against their ceiling, one GPU.

    python tools/bench_grouped_gemm.py                          # every shape at EP = 1, 2, 4
    python tools/bench_grouped_gemm.py --config QWEN3_30B_A3B --ep 2 --json grouped.json

Each MoE layer runs six grouped GEMMs per micro-batch (``torch._grouped_mm``, megatron/core/transformer/moe/
experts.py): fc1 and fc2 forward, their input gradients (dgrad) and their weight gradients (wgrad, the row blocks
splitting the reduction). With balanced routing a rank holds E / EP experts and receives seq x mbs x top-k token
rows, an equal block per expert. For each GEMM this prints its time and TFLOP/s and the same FLOPs as one plain
``torch.mm`` (all rows against one expert's matrix: what the GEMM would cost if grouping were free), and the
large-square ceiling (8192^3). The ratio grouped / plain says how much of an MoE row's expert time is lost to
the grouping (many small blocks) rather than to the FLOPs; the plain GEMM / ceiling ratio says what the shape's
width costs. For the two weight gradients it also times their way into DDP's fp32 ``main_grad`` (the add of
each later micro-batch, the first one's write) against the Triton GEMM that adds in its epilogue
(megatron/core/fusions/grouped_wgrad.py, CUDA only), the two ways the experts' backward chooses between.
Timing: torch.utils.benchmark, the mean of ``--iters`` calls after ``--warmup``; on CPU fp32 (for tests).
"""
import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
import torch.utils.benchmark as benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.core.fusions.grad_accumulation import accumulate_into_main_grad  # noqa: E402
from megatron.core.fusions.grouped_wgrad import _fused_way, _kernel, fused_available  # noqa: E402


@dataclass(frozen=True)
class ExpertShape:
    """The expert part of one config of ../shared/megatron_reference/configs.sh (Megatron's flag names)."""
    hidden: int  # --hidden-size
    ffn: int  # --moe-ffn-hidden-size (SwiGLU: fc1 is 2 x ffn wide)
    experts: int  # --num-experts
    topk: int  # --moe-router-topk
    tokens: int  # --seq-length x --micro-batch-size: one micro-batch's tokens per rank


SHAPES: Dict[str, ExpertShape] = {
    "MOE_MIXTRAL": ExpertShape(hidden=2048, ffn=5632, experts=8, topk=2, tokens=4096 * 2),
    "MOE_FINE": ExpertShape(hidden=2048, ffn=1408, experts=64, topk=6, tokens=4096 * 2),
    "QWEN3_30B_A3B": ExpertShape(hidden=2048, ffn=768, experts=128, topk=8, tokens=4096),
    "DEEPSEEK_V3_PROXY": ExpertShape(hidden=7168, ffn=2048, experts=32, topk=8, tokens=4096),
}


def _timer(device: torch.device, iters: int, warmup: int) -> Callable[[Callable[[], object]], float]:
    """A function that times ``fn``: ms per call over ``iters`` calls after ``warmup`` untimed ones
    (torch.utils.benchmark, which synchronizes CUDA around the timed block; ``device`` only documents where)."""
    def time_ms(fn):
        for _ in range(warmup):
            fn()
        return benchmark.Timer(stmt="fn()", globals={"fn": fn}).timeit(iters).mean * 1e3
    return time_ms


def bench_shape(name: str, shape: ExpertShape, ep: int, device: torch.device, dtype: torch.dtype,
                time_ms: Callable[[Callable[[], object]], float]) -> List[Dict]:
    """The six grouped GEMMs of one MoE layer and micro-batch at expert parallelism ``ep``, each against the
    plain GEMM of the same FLOPs."""
    if shape.experts % ep:
        raise ValueError(f"{name}: {shape.experts} experts do not split over EP={ep}")
    local = shape.experts // ep
    rows = shape.tokens * shape.topk
    if rows % local:
        raise ValueError(f"{name}: {rows} token rows do not split evenly over {local} local experts")
    per_expert = rows // local
    h, f = shape.hidden, shape.ffn
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*size):
        return (torch.randn(*size, generator=g) * 0.02).to(device=device, dtype=dtype)

    offs = torch.arange(1, local + 1, dtype=torch.int32, device=device) * per_expert
    x, w1, w2 = rand(rows, h), rand(local, 2 * f, h), rand(local, h, f)
    act, g1, g2 = rand(rows, f), rand(rows, 2 * f), rand(rows, h)
    gemms = {  # name: (grouped call, plain call of the same FLOPs, FLOPs)
        "fc1 forward": (lambda: torch._grouped_mm(x, w1.transpose(1, 2), offs=offs),
                        lambda: torch.mm(x, w1[0].t()), 2 * rows * h * 2 * f),
        "fc1 dgrad": (lambda: torch._grouped_mm(g1, w1, offs=offs), lambda: torch.mm(g1, w1[0]), 2 * rows * 2 * f * h),
        "fc1 wgrad": (lambda: torch._grouped_mm(g1.t(), x, offs=offs), lambda: torch.mm(g1.t(), x),
                      2 * rows * 2 * f * h),
        "fc2 forward": (lambda: torch._grouped_mm(act, w2.transpose(1, 2), offs=offs),
                        lambda: torch.mm(act, w2[0].t()), 2 * rows * f * h),
        "fc2 dgrad": (lambda: torch._grouped_mm(g2, w2, offs=offs), lambda: torch.mm(g2, w2[0]), 2 * rows * h * f),
        "fc2 wgrad": (lambda: torch._grouped_mm(g2.t(), act, offs=offs), lambda: torch.mm(g2.t(), act),
                      2 * rows * h * f),
    }
    out = []
    for gemm, (grouped, plain, flops) in gemms.items():
        grouped_ms, plain_ms = time_ms(grouped), time_ms(plain)
        row = {"config": name, "ep": ep, "gemm": gemm, "local_experts": local, "rows_per_expert": per_expert,
               "grouped_ms": grouped_ms, "plain_ms": plain_ms,
               "grouped_tflops": flops / grouped_ms / 1e9, "plain_tflops": flops / plain_ms / 1e9}
        if gemm.endswith("wgrad"):
            # The weight gradient's way into DDP's fp32 buffer (the grouped GEMMs' are not fused into it): the
            # add of every later micro-batch and the first one's write (distributed_data_parallel._grad_hook).
            grad_w = grouped()
            main = torch.zeros(grad_w.shape, dtype=torch.float32, device=device)
            row["accumulate_ms"] = time_ms(lambda: accumulate_into_main_grad(main, grad_w))
            row["overwrite_ms"] = time_ms(lambda: accumulate_into_main_grad(main, grad_w, overwrite=True))
            a, b = (g1, x) if gemm.startswith("fc1") else (g2, act)
            if fused_available(main, a, b):  # the Triton GEMM that adds in its epilogue (fusions/grouped_wgrad.py)
                by_config = {cfg: time_ms(lambda: _fused_way(main, a, b, offs, False, cfg)) for cfg in _kernel()[1]}
                best = min(by_config, key=by_config.get)
                row["fused_add_ms"], row["fused_tiles"] = by_config[best], list(best)
                row["fused_write_ms"] = time_ms(lambda: _fused_way(main, a, b, offs, True, best))
        out.append(row)
    return out


def ceiling_tflops(device: torch.device, dtype: torch.dtype, time_ms, n: int = 8192) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / time_ms(lambda: torch.mm(a, b)) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--ep", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--scale", type=int, default=1,
                   help="divide hidden, ffn and tokens by this (small shapes for a CPU check of the tool)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    if not hasattr(torch, "_grouped_mm"):
        print("bench_grouped_gemm: this torch has no torch._grouped_mm (the grouped experts' GEMM)", file=sys.stderr)
        return 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    time_ms = _timer(device, args.iters, args.warmup)
    ceiling = ceiling_tflops(device, dtype, time_ms, 8192 // args.scale)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, {dtype}; large-square ceiling ({8192 // args.scale}^3): {ceiling:.1f} TFLOP/s")
    print("| config | EP | GEMM | local experts x rows | grouped ms | grouped TFLOP/s | plain TFLOP/s | "
          "grouped / plain | plain / ceiling |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for cfg in args.config:
        base = SHAPES[cfg]
        shape = ExpertShape(base.hidden // args.scale, base.ffn // args.scale, base.experts, base.topk,
                            base.tokens // args.scale)
        for ep in args.ep:
            if base.experts % ep:
                continue
            for r in bench_shape(cfg, shape, ep, device, dtype, time_ms):
                r["ceiling_tflops"] = ceiling
                rows.append(r)
                print(f"| {cfg} | {ep} | {r['gemm']} | {r['local_experts']} x {r['rows_per_expert']} | "
                      f"{r['grouped_ms']:.3f} | {r['grouped_tflops']:.1f} | {r['plain_tflops']:.1f} | "
                      f"{r['grouped_tflops'] / r['plain_tflops']:.0%} | {r['plain_tflops'] / ceiling:.0%} |")
            layer = [r for r in rows if r["config"] == cfg and r["ep"] == ep]
            grouped, plain = sum(r["grouped_ms"] for r in layer), sum(r["plain_ms"] for r in layer)
            print(f"| {cfg} | {ep} | **six GEMMs, one layer and micro-batch** | | {grouped:.3f} | | | "
                  f"{plain / grouped:.0%} of the plain GEMMs' speed | |")
            add = sum(r["accumulate_ms"] for r in layer if "accumulate_ms" in r)
            write = sum(r["overwrite_ms"] for r in layer if "overwrite_ms" in r)
            wg = [r for r in layer if "accumulate_ms" in r]
            gemm_ms = sum(r["grouped_ms"] for r in wg)
            print(f"| {cfg} | {ep} | **both weight gradients into the fp32 buffer** | | grouped GEMM {gemm_ms:.3f} "
                  f"+ add {add:.3f} (first write {write:.3f}) | | | | |")
            if all("fused_add_ms" in r for r in wg):
                fused = sum(r["fused_add_ms"] for r in wg)
                first = sum(r["fused_write_ms"] for r in wg)
                print(f"| {cfg} | {ep} | **the same, fused (GEMM adding in fp32)** | | {fused:.3f} (first write "
                      f"{first:.3f}) | | | {(gemm_ms + add) / fused:.2f}x | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "dtype": str(dtype), "ceiling_tflops": ceiling, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
