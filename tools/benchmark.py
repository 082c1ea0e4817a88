"""Training-throughput benchmark on mock data through the real training components.

    python tools/benchmark.py --config gpt-1.3b [--iters 20 --warmup 5] [-- <any Megatron flags>]
    torchrun --nproc-per-node 8 tools/benchmark.py --config llama3-8b -- --tensor-model-parallel-size 8
    python tools/benchmark.py --config gpt-1.3b --dry-run       # memory / FLOPs estimate only
    python tools/benchmark.py --table results.jsonl             # markdown table of earlier runs

It builds the model with pretrain_gpt.py's providers, the optimizer and the data loader exactly as
pretrain() does, then times `train_step` per iteration (device synchronised before and after) and
reports the median over the steady-state iterations: ms/iteration, tokens/s, TFLOP/s/GPU (Megatron's
formula, megatron/training/flops.py), MFU against the dense bf16 peak of the detected device
(table DENSE_BF16_PEAK_TFLOPS in megatron/training/flops.py), and peak allocated memory next to the estimate.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.flops import DENSE_BF16_PEAK_TFLOPS, dense_bf16_peak  # noqa: E402,F401 (after sys.path; re-exported)

_COMMON = ("--mock-data --tokenizer-type NullTokenizer --bf16 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine "
           "--lr-warmup-iters 2 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 "
           "--attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 --log-interval 1000000 "
           "--eval-iters 0 --no-create-attention-mask-in-dataloader --num-workers 1")

# Named configs: Megatron flags. Vocab: NullTokenizer adds one EOD token, so --vocab-size V-1 gives V
# after padding to a multiple of 128.
CONFIGS = {
    "tiny": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
            "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2 --vocab-size 511",
    # GPT-3 Small shape: 12 x 768, 12 heads; 8 x 2048 = 16,384 tokens per iteration.
    "gpt-125m": "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --ffn-hidden-size 3072 "
                "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 8 --global-batch-size 8 "
                "--vocab-size 50303",
    # The reference: 24 x 2048, 16 heads, ffn 8192, learned positions, LayerNorm, GeLU, biases,
    # tied embeddings; 4 x 2048 = 8,192 tokens per iteration.
    "gpt-1.3b": "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 "
                "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 4 "
                "--vocab-size 50303",
    # Llama-3-8B layer shape (4096 hidden, 32 heads / 8 KV groups, SwiGLU 14336, RMSNorm, RoPE 500k,
    # vocab 128256, seq 8192, untied, no biases) with 6 of its 32 layers so weights + fp32 Adam state
    # (18 B/param x 2.36B params = 42 GB) and activations fit on one 80 GB GPU.
    "llama3-8b": "--num-layers 6 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
                 "--num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
                 "--norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 500000 "
                 "--disable-bias-linear --untie-embeddings-and-output-weights --seq-length 8192 "
                 "--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 1 --vocab-size 128255",
}

# The fast path in one switch: compiled layers and the chunked 16-bit cross entropy.
FAST_FLAGS = "--torch-compile --cross-entropy-loss-fusion"


def parse_cli(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="gpt-1.3b")
    p.add_argument("--fast", action="store_true", help=f"add the fast-path flags: {FAST_FLAGS}")
    p.add_argument("--iters", type=int, default=20, help="timed steady-state iterations")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations (compile, allocator warm-up)")
    p.add_argument("--dry-run", action="store_true", help="print the memory / FLOPs estimate and exit")
    p.add_argument("--results", default=None, help="append one JSON line per run to this file")
    p.add_argument("--label", default=None, help="name of this run in the results (default: config + flags)")
    p.add_argument("--no-gc", action="store_true",
                   help="freeze and disable Python's cyclic GC while timing (what --manual-gc aims at)")
    p.add_argument("--profile", type=int, default=0,
                   help="after timing, profile N more iterations and print the top kernels by device time")
    p.add_argument("--profile-rows", type=int, default=30, help="kernels listed by --profile")
    p.add_argument("--table", default=None, help="print a markdown table of a results file and exit")
    if "--" in argv:
        i = argv.index("--")
        ours, extra = argv[:i], argv[i + 1:]
    else:
        ours, extra = argv, []
    return p.parse_args(ours), extra


def megatron_argv(cli, extra):
    flags = f"{_COMMON} {CONFIGS[cli.config]} {FAST_FLAGS if cli.fast else ''}".split()
    total = cli.warmup + cli.iters
    if total <= 2:  # the LR warmup (2 iterations) must end before the run does
        flags += ["--lr-warmup-iters", str(max(0, total - 1))]
    return flags + list(extra) + ["--train-iters", str(total)]


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(argv):
    """initialize_megatron + model/optimizer/scheduler + train iterator, as pretrain() builds them."""
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    from megatron.training.arguments import parse_args
    from megatron.training.data_iterators import build_iterators_for_model_chunks
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model_setup import setup_model_and_optimizer
    from megatron.training.training import _setup_config
    from pretrain_gpt import model_provider, train_valid_test_datasets_provider

    initialize_megatron(parsed_args=parse_args(argv=argv))
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider, ModelType.encoder_or_decoder)
    config = get_model_config(model[0])
    train_it, _, _ = build_iterators_for_model_chunks(train_valid_test_datasets_provider, model)
    for chunk in model:
        chunk.train()
    _setup_config(config, model, optimizer)
    return model, optimizer, scheduler, config, train_it


def time_iterations(model, optimizer, scheduler, config, train_it, warmup, iters, fb_func=None):
    """Per-iteration seconds and losses; peak memory counted over the timed iterations only.

    On CUDA the timed iterations run back to back, as in training: an event is recorded on the stream
    at the start of each step and the device is synchronised only after the last one, so a step's time
    includes any wait for the host (launch overhead) but not a benchmark-imposed sync. (The step still
    synchronises where training does: the grad norm, and the loss check under CUDA graphs.)
    """
    import torch

    from megatron.training.train_step import train_step
    from pretrain_gpt import forward_step
    cuda = torch.cuda.is_available()
    losses, events, times = [], [], []
    for i in range(warmup + iters):
        if i == warmup:
            _sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
        if cuda and i >= warmup:
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        start = time.perf_counter()
        loss_dict, skipped, *_ = train_step(forward_step, train_it, model, optimizer, scheduler, config,
                                            fb_func)
        losses.append(loss_dict.get("lm loss"))
        if i < warmup or not cuda:
            _sync()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times.append(elapsed)
            print(f"benchmark iteration {i + 1:4d}: {elapsed * 1000:9.1f} ms  lm loss {_float(losses[-1]):.4f}"
                  f"{'  (warm-up)' if i < warmup else ''}", flush=True)
    if cuda:
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
        _sync()
        times = [a.elapsed_time(b) / 1000 for a, b in zip(events, events[1:])]
        for i, t in enumerate(times):
            print(f"benchmark iteration {warmup + i + 1:4d}: {t * 1000:9.1f} ms  "
                  f"lm loss {_float(losses[warmup + i]):.4f}", flush=True)
    return times, [_float(x) for x in losses]


def _float(value):
    return float(value) if value is not None else float("nan")


def profile_iterations(model, optimizer, scheduler, config, train_it, n, rows=30, fb_func=None):
    """Kernel-level breakdown of ``n`` iterations (torch.profiler), sorted by total device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron.training.train_step import train_step
    from pretrain_gpt import forward_step
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(n):
            train_step(forward_step, train_it, model, optimizer, scheduler, config, fb_func)
        _sync()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70), flush=True)


def summarize(args, cli, times, losses, estimate):
    import torch

    from megatron.training.flops import num_floating_point_operations
    gbs = args.global_batch_size
    median = statistics.median(times)
    flops = num_floating_point_operations(args, gbs)
    tflops = flops / (median * 1e12 * args.world_size)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = dense_bf16_peak(device)
    mem = torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None
    # A captured CUDA graph keeps its activations in a private pool allocated before the timed steps:
    # max_memory_allocated misses it, the reserved peak does not.
    reserved = torch.cuda.max_memory_reserved() / 2 ** 30 if torch.cuda.is_available() else None
    return {
        "label": cli.label or f"{cli.config}{' fast' if cli.fast else ''}", "config": cli.config,
        "device": device, "world_size": args.world_size, "ms_per_iter": median * 1000,
        "ms_min": min(times) * 1000, "ms_max": max(times) * 1000,
        "tokens_per_s": gbs * args.seq_length / median, "tflops_per_gpu": tflops,
        "mfu": tflops / peak if peak else None, "peak_tflops": peak, "peak_mem_gib": mem, "peak_reserved_gib": reserved,
        "est_mem_gib": estimate["total"] / 2 ** 30, "flops_per_iter": flops,
        "first_loss": losses[0], "last_loss": losses[-1], "losses": losses, "argv": " ".join(sys.argv[1:]),
    }


def print_result(r):
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "n/a"
    if r.get("peak_reserved_gib") is not None:
        mem += f" (reserved {r['peak_reserved_gib']:.1f})"
    print(f"benchmark result | {r['label']} | {r['device']} | {r['ms_per_iter']:.1f} ms/iter "
          f"(min {r['ms_min']:.1f}, max {r['ms_max']:.1f}) | {r['tokens_per_s']:.0f} tokens/s | "
          f"{r['tflops_per_gpu']:.1f} TFLOP/s/GPU | MFU {mfu} (peak {r['peak_tflops']}) | "
          f"peak mem {mem} GiB (estimate {r['est_mem_gib']:.1f}) | loss {r['first_loss']:.3f} -> "
          f"{r['last_loss']:.3f}", flush=True)


def print_table(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print("| run | device | ms/iter | tokens/s | TFLOP/s/GPU | MFU | peak mem GiB (est.) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        mem = f"{r['peak_mem_gib']:.1f} ({r['est_mem_gib']:.1f})" if r.get("peak_mem_gib") else "n/a"
        print(f"| {r['label']} | {r['device']} | {r['ms_per_iter']:.1f} | {r['tokens_per_s']:.0f} | "
              f"{r['tflops_per_gpu']:.1f} | {mfu} | {mem} |")


def main(argv=None):
    cli, extra = parse_cli(sys.argv[1:] if argv is None else argv)
    if cli.table:
        print_table(cli.table)
        return None
    from megatron.training.theoretical_memory_usage import estimate_memory_and_flops, print_estimate
    margv = megatron_argv(cli, extra)
    if cli.dry_run:
        from megatron.training.arguments import parse_args, validate_args
        args = validate_args(parse_args(argv=margv))
        print_estimate(estimate_memory_and_flops(args))
        return None
    built = build(margv)
    from megatron.training.global_vars import get_args
    args = get_args()
    estimate = estimate_memory_and_flops(args)
    print_estimate(estimate)
    if cli.no_gc:
        import gc
        gc.collect()
        gc.freeze()  # long-lived objects out of the young generations
        gc.disable()
    from megatron.training.train_step import get_training_forward_backward_func
    fb_func = get_training_forward_backward_func()  # one per run: it may own a CUDA graph
    times, losses = time_iterations(*built, cli.warmup, cli.iters, fb_func=fb_func)
    result = summarize(args, cli, times, losses, estimate)
    if cli.profile:
        profile_iterations(*built, cli.profile, rows=cli.profile_rows, fb_func=fb_func)
    import torch
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        print_result(result)
        if cli.results:
            with open(cli.results, "a") as f:
                f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
