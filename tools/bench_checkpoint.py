"""Checkpoint save/load timing on a benchmark config (tools/benchmark.py's named configs, mock data).

    python tools/bench_checkpoint.py --config gpt-1.3b --save-dir /tmp/ckpt [-- <any Megatron flags>]

Builds model + optimizer as pretrain() does, trains a few iterations, then measures: a synchronous
torch_dist save, an asynchronous save (time training is blocked, time until the save is recorded, and
the iteration time while it writes in the background), and a load back into the same model. Prints one
line per measurement and the checkpoint size on disk.
"""
import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.benchmark import CONFIGS, _sync, build, megatron_argv  # noqa: E402


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _steps(model, optimizer, scheduler, config, train_it, n):
    from megatron.training.async_utils import maybe_finalize_async_save
    from megatron.training.train_step import train_step
    from pretrain_gpt import forward_step
    times = []
    for _ in range(n):
        _sync()
        start = time.perf_counter()
        train_step(forward_step, train_it, model, optimizer, scheduler, config)
        maybe_finalize_async_save(blocking=False)  # what the training loop does each iteration
        _sync()
        times.append(time.perf_counter() - start)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="gpt-1.3b")
    p.add_argument("--save-dir", required=True)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    cli = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    cli.fast, cli.warmup, cli.iters = False, 3, 8
    shutil.rmtree(cli.save_dir, ignore_errors=True)
    flags = megatron_argv(cli, extra) + ["--save", cli.save_dir, "--save-interval", "1000000",
                                         "--load", cli.save_dir, "--ckpt-format", "torch_dist"]
    model, optimizer, scheduler, config, train_it = build(flags)

    from megatron.training.async_utils import maybe_finalize_async_save
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron.training.global_vars import get_args
    from megatron.training.utils import print_rank_0
    args = get_args()
    _steps(model, optimizer, scheduler, config, train_it, 2)  # warm-up
    base = statistics.median(_steps(model, optimizer, scheduler, config, train_it, 4))

    _sync()
    t0 = time.perf_counter()
    save_checkpoint(1, model, optimizer, scheduler, 0)
    sync_s = time.perf_counter() - t0
    size = _dir_bytes(os.path.join(cli.save_dir, "iter_0000001"))

    args.async_save = True
    _sync()
    t0 = time.perf_counter()
    save_checkpoint(2, model, optimizer, scheduler, 0)
    blocked_s = time.perf_counter() - t0
    during = _steps(model, optimizer, scheduler, config, train_it, 4)
    maybe_finalize_async_save(blocking=True)
    async_total_s = time.perf_counter() - t0
    args.async_save = False

    _sync()
    t0 = time.perf_counter()
    load_checkpoint(model, optimizer, scheduler)
    _sync()
    load_s = time.perf_counter() - t0

    print_rank_0(f"checkpoint result | config {cli.config} | size on disk {size / 1e9:.2f} GB | "
                 f"sync save {sync_s:.2f} s | async save blocks "
                 f"{blocked_s:.2f} s, recorded after {async_total_s:.2f} s | iteration {base * 1000:.0f} ms "
                 f"normally, {statistics.median(during) * 1000:.0f} ms while writing | load {load_s:.2f} s")


if __name__ == "__main__":
    main()
