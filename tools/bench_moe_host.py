"""What one MoE layer costs the host and the GPU, with and without Megatron's fusion flags, one GPU.

    python tools/bench_moe_host.py                                   # QWEN3_30B_A3B's layer
    python tools/bench_moe_host.py --config MOE_FINE --json host.json

The expert-parallel rows of the MoE benchmarks are host-bound where many small experts meet many layers (Qwen3's
128 experts of ffn 768: the GPU idles while the host launches). For one MoE layer at a config's shape (router,
all-to-all dispatcher at EP=1, grouped experts, the balancing loss; forward + backward, bf16) this prints, for the
default path, ``--moe-permute-fusion`` and ``--moe-permute-fusion --moe-router-fusion``:
- kernels: CUDA kernels launched per forward + backward (torch.profiler);
- host ms: the host's time to issue one forward + backward at a small token count (``--host-tokens``), where the
  GPU finishes each kernel before the next is issued, so the wall time is the host's;
- GPU ms: one forward + backward at the config's micro-batch (CUDA events, the GPU's time).
On CPU (tests) the same runs with fp32 and the given sizes; the fusion flags then take their eager fallbacks.
"""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.core.models.gpt.gpt_layer_specs import get_moe_module_spec  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

# The MoE part of ../shared/megatron_reference/configs.sh's configs: hidden, expert ffn, experts, top-k, tokens per
# micro-batch (seq x mbs), shared-expert ffn (0: none), score function.
CONFIGS = {
    "QWEN3_30B_A3B": dict(hidden=2048, ffn=768, experts=128, topk=8, tokens=4096, shared=0, score="softmax"),
    "MOE_FINE": dict(hidden=2048, ffn=1408, experts=64, topk=6, tokens=8192, shared=2816, score="softmax"),
    "MOE_MIXTRAL": dict(hidden=2048, ffn=5632, experts=8, topk=2, tokens=8192, shared=0, score="softmax"),
    "DEEPSEEK_V3_PROXY": dict(hidden=7168, ffn=2048, experts=32, topk=8, tokens=4096, shared=2048, score="sigmoid"),
}
VARIANTS = {"default": {}, "permute-fusion": dict(moe_permute_fusion=True),
            "permute+router-fusion": dict(moe_permute_fusion=True, moe_router_fusion=True)}


def build_layer(shape: dict, variant: dict, device: str, dtype: torch.dtype):
    extra = {}
    if shape["score"] == "sigmoid":  # DeepSeek-V3's routing: sigmoid scores, expert bias, 8 groups of which 4 kept
        extra = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=8,
                     moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=shape["hidden"], num_attention_heads=16, num_moe_experts=shape["experts"],
        moe_router_topk=shape["topk"], moe_ffn_hidden_size=shape["ffn"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3,
        moe_shared_expert_intermediate_size=shape["shared"] or None, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, **extra, **variant)
    layer = build_module(get_moe_module_spec(num_experts=shape["experts"], moe_grouped_gemm=True), config=cfg)
    return layer.to(device=device, dtype=dtype)


def step(layer, x, grad):
    out, _ = layer(x)
    out.backward(grad)


def count_kernels(layer, x, grad) -> int:
    from torch.profiler import ProfilerActivity, profile  # lazy: only for the kernel count
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(layer, x, grad)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def host_ms(layer, x, grad, iters: int) -> float:
    for _ in range(3):
        step(layer, x, grad)
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step(layer, x, grad)
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def gpu_ms(layer, x, grad, iters: int) -> float:
    for _ in range(3):
        step(layer, x, grad)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step(layer, x, grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def inputs(shape: dict, tokens: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, 1, shape["hidden"], device=device, dtype=dtype, generator=g).requires_grad_()
    return x, torch.randn(tokens, 1, shape["hidden"], device=device, dtype=dtype, generator=g)


def measure(shape: dict, host_tokens: int, iters: int, device: str) -> list:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for name, variant in VARIANTS.items():
        torch.manual_seed(0)
        layer = build_layer(shape, variant, device, dtype)
        small = inputs(shape, host_tokens, device, dtype)
        row = {"variant": name, "host_ms": host_ms(layer, *small, iters)}
        if device == "cuda":
            full = inputs(shape, shape["tokens"], device, dtype)
            row["kernels"] = count_kernels(layer, *full)
            row["gpu_ms"] = gpu_ms(layer, *full, iters)
        rows.append(row)
        del layer
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="QWEN3_30B_A3B")
    p.add_argument("--host-tokens", type=int, default=256, help="tokens of the host-time runs (small: host-bound)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="a small layer (tests; CPU)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    shape = dict(CONFIGS[args.config])
    if args.tiny:
        shape.update(hidden=32, ffn=16, experts=min(shape["experts"], 16), tokens=64,
                     shared=16 if shape["shared"] else 0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = measure(shape, min(args.host_tokens, shape["tokens"]), args.iters, device)
    print(f"{args.config} MoE layer ({shape['experts']} experts, top-{shape['topk']}, hidden {shape['hidden']}, "
          f"ffn {shape['ffn']}), forward + backward on {device}")
    print(f"{'variant':24s} {'kernels':>8s} {'host ms':>9s} {'GPU ms':>8s}")
    for r in rows:
        print(f"{r['variant']:24s} {r.get('kernels', '-'):>8} {r['host_ms']:9.3f} "
              f"{r['gpu_ms'] if 'gpu_ms' in r else float('nan'):8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "device": device, "shape": shape, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
