"""Checkpoint cost on a benchmark config (tools/benchmark.py's named configs, mock data), against the disk and
against torch.distributed.checkpoint (DCP) itself.

    python tools/bench_checkpoint.py --config gpt-1.3b --save-dir /tmp/ckpt [-- <any Megatron flags>]
    torchrun --nproc-per-node 2 tools/bench_checkpoint.py --config llama3-8b --save-dir /nvme/ckpt --keep \\
        -- --num-layers 32 --global-batch-size 2 --use-distributed-optimizer   # Llama-3-8B, DP=2
    torchrun --nproc-per-node 2 tools/bench_checkpoint.py --config llama3-8b --save-dir /nvme/ckpt --load-only \\
        -- --num-layers 32 --use-distributed-optimizer --tensor-model-parallel-size 2   # resharded to TP=2

Builds model + optimizer as pretrain() does, trains a few iterations, then measures, one line each:
- disk: sequential write bandwidth of the save directory's file system (every rank writes its own file
  of --disk-gib GiB in 64 MiB blocks, then fsync; aggregate = all bytes / the slowest rank's time);
- a synchronous torch_dist save (size on disk, time, GB/s, % of the disk's bandwidth) and its load;
- the reservation the training loop makes after its first step (unless --no-reserve): the page-locked host
  buffers of the first async save, allocated in the background, how long that took and the iteration time
  meanwhile;
- --async-saves background saves: the time training is blocked in save_checkpoint, split into allocating
  the host buffers (the first save only), launching the device-to-host copies, waiting for copies (CPU
  tensors, or pageable buffers with -- --no-async-save-pinned-buffers) and the rest (state dict, sharding
  check, common state, staging directory); the device time of the background copy; the time until the
  save is recorded (training steps run meanwhile) and the iteration time while it writes;
- the anchor: DCP's own async_save (and save) of the same tensors (each rank's main replicas, no
  deduplication work left to DCP), blocked time and total time;
- --load-only: the time to load the checkpoint already under --save-dir into this run's layout (pass
  another TP/PP/DP layout than the one that saved it: a resharding load).
Checkpoints are deleted once measured (one ~100 GB Llama-3-8B checkpoint at a time must fit on the disk);
--keep leaves the last async one for a --load-only run. Rank 0 prints the lines and, with --results, appends
them as one JSON line.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.benchmark import CONFIGS, _sync, build, megatron_argv  # noqa: E402

BLOCK = 64 << 20


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _barrier():
    import torch
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _rank_world():
    import torch
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _memory_mark():
    """Start a peak-memory window on the device; returns the bytes held now (0 without CUDA)."""
    import torch
    if not torch.cuda.is_available():
        return 0
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _load_memory(held_before):
    """(GB held before the load, peak GB during it), the largest over ranks: what the load needs on top of
    the model and optimizer it loads into."""
    import torch
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return _max_over_ranks(held_before / 1e9), _max_over_ranks(peak / 1e9)


def _max_over_ranks(value):
    import torch
    if not torch.distributed.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64,
                     device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()


def _per_rank(value):
    """[value of rank 0, rank 1, ...]."""
    import torch
    if not torch.distributed.is_initialized():
        return [value]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def disk_write_bandwidth(directory, gib):
    """Aggregate GB/s of every rank writing ``gib`` GiB sequentially (64 MiB writes, fsync), like dd."""
    rank, world = _rank_world()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"ddtest_rank{rank}")
    block = os.urandom(BLOCK)  # incompressible
    n = max(1, int(gib * (1 << 30)) // BLOCK)
    _barrier()
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(n):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = _max_over_ranks(time.perf_counter() - start)
    os.remove(path)
    _barrier()
    return world * n * BLOCK / elapsed / 1e9


def _steps(model, optimizer, scheduler, config, train_it, n, until_saved=False, until=None):
    """Per-step seconds of ``n`` training steps (with ``until_saved``: until the pending async save is recorded,
    with ``until``: until it returns True on every rank; at most ``n``), finalizing async saves after each step
    as the training loop does."""
    from megatron.training.async_utils import is_empty_async_queue, maybe_finalize_async_save
    from megatron.training.train_step import train_step
    from pretrain_gpt import forward_step
    times = []
    for _ in range(n):
        _sync()
        start = time.perf_counter()
        train_step(forward_step, train_it, model, optimizer, scheduler, config)
        maybe_finalize_async_save(blocking=False)
        _sync()
        times.append(time.perf_counter() - start)
        if until_saved and is_empty_async_queue():
            break
        if until is not None and -_max_over_ranks(-float(until())) > 0:  # the same verdict on every rank
            break
    return times


def _remove(save_dir, iteration):
    rank, _ = _rank_world()
    _barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(save_dir, f"iter_{iteration:07d}"), ignore_errors=True)
    _barrier()


def _dcp_state(model, optimizer, scheduler):
    """This rank's main-replica tensors of the checkpoint, as plain tensors under unique keys: what our
    torch_dist save writes, handed to DCP with nothing left to plan or deduplicate."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import iter_leaves
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica
    from megatron.core.dist_checkpointing.strategies.fully_parallel import distribute_main_replicas
    from megatron.training.checkpointing import state
    from megatron.training.global_vars import get_args
    sd = state.generate_state_dict(get_args(), model, optimizer, scheduler, None, 0, 0, sharded=True,
                                   save_rng=False)
    apply_factories(sd)
    if getattr(get_args(), "ckpt_fully_parallel_save", True) and ps.model_parallel_is_initialized():
        # The same writers as our save: DP-replicated weights spread over the DP ranks.
        distribute_main_replicas(sd, ps.get_data_parallel_group(with_context_parallel=True))
    out = {}
    for _, leaf in iter_leaves(sd):
        if isinstance(leaf, ShardedTensor) and is_main_replica(leaf.replica_id) and leaf.data is not None:
            where = "_".join(map(str, leaf.global_offset))
            if leaf.flattened_range is not None:
                where += f"_f{leaf.flattened_range.start}"
            out[f"{leaf.key}@{where}"] = leaf.data
    return out


def dcp_anchor(model, optimizer, scheduler, directory):
    """(blocked s, total s of DCP async_save, total s of DCP save, GB) for the same tensors."""
    import torch
    import torch.distributed.checkpoint as dcp
    rank, _ = _rank_world()
    sd = _dcp_state(model, optimizer, scheduler)
    group = torch.distributed.new_group(backend="gloo") if torch.distributed.is_initialized() else None
    out = []
    for mode in ("async", "sync"):
        path = os.path.join(directory, mode)
        _barrier()
        _sync()
        start = time.perf_counter()
        if mode == "async":
            future = dcp.async_save(sd, checkpoint_id=path, process_group=group)
            blocked = _max_over_ranks(time.perf_counter() - start)
            future.result()
        else:
            dcp.save(sd, checkpoint_id=path, process_group=group)
        _barrier()
        total = time.perf_counter() - start
        size = _dir_bytes(path) if rank == 0 else 0
        out.append((blocked if mode == "async" else None, total, size / 1e9))
        _barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    return out[0][0], out[0][1], out[1][1], out[1][2]


def _check_disk(save_dir, model, optimizer, scheduler):
    """Refuse up front when one checkpoint cannot fit on the disk (one line with the numbers)."""
    import torch
    need = sum(t.numel() * t.element_size() for t in _dcp_state(model, optimizer, scheduler).values())
    need = _max_over_ranks(need) * (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
    os.makedirs(save_dir, exist_ok=True)
    free = shutil.disk_usage(save_dir).free
    if need * 1.1 > free:
        raise SystemExit(f"error: one checkpoint needs about {need / 1e9:.0f} GB but {save_dir} has "
                         f"{free / 1e9:.0f} GB free; use a larger disk or fewer layers (-- --num-layers N)")
    return need


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="gpt-1.3b")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--async-saves", type=int, default=2, help="background saves measured one after another")
    p.add_argument("--disk-gib", type=float, default=4.0, help="GiB each rank writes for the disk bandwidth")
    p.add_argument("--no-anchor", action="store_true", help="skip DCP's own save and async_save")
    p.add_argument("--no-sync", action="store_true",
                   help="skip the synchronous save and its load (measure the async saves only)")
    p.add_argument("--no-reserve", action="store_true",
                   help="let the first async save allocate its host buffers (the training loop reserves them "
                        "in the background after its first step)")
    p.add_argument("--keep", action="store_true", help="keep the last async checkpoint (for a --load-only run)")
    p.add_argument("--load-only", action="store_true",
                   help="only time loading the checkpoint under --save-dir into this run's layout")
    p.add_argument("--results", default=None, help="append the measurements as one JSON line to this file")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    cli = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    cli.fast, cli.warmup, cli.iters = False, 3, 8
    if not cli.load_only and os.path.isdir(cli.save_dir) and int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(cli.save_dir, ignore_errors=True)
    flags = megatron_argv(cli, extra) + ["--save", cli.save_dir, "--save-interval", "1000000",
                                         "--load", cli.save_dir, "--ckpt-format", "torch_dist"]
    # --load-only: the model is built without loading; the load below is the one timed.
    model, optimizer, scheduler, config, train_it = build(_without_load(flags) if cli.load_only else flags)

    from megatron.training.async_utils import last_staging_stats, maybe_finalize_async_save
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron.training.global_vars import get_args
    from megatron.training.utils import print_rank_0
    args = get_args()
    rank, world = _rank_world()
    layout = (f"TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
              f"DP={args.data_parallel_size} distopt={int(bool(args.use_distributed_optimizer))}")
    result = {"config": cli.config, "layers": args.num_layers, "layout": layout, "world": world}

    if cli.load_only:
        args.load, args.exit_on_missing_checkpoint = cli.save_dir, True
        _sync()
        _barrier()
        held = _memory_mark()
        t0 = time.perf_counter()
        iteration, _ = load_checkpoint(model, optimizer, scheduler)
        _sync()
        result["load_s"] = _max_over_ranks(time.perf_counter() - t0)
        result["load_held_gb"], result["load_peak_gb"] = _load_memory(held)
        print_rank_0(f"checkpoint load | {layout} | iteration {iteration} from {cli.save_dir} | load "
                     f"{result['load_s']:.2f} s | device memory {result['load_held_gb']:.1f} GB held, "
                     f"{result['load_peak_gb']:.1f} GB peak during the load")
        _write(cli, result, rank)  # before training on: a step that fails still leaves the load measured
        after = statistics.median(_steps(model, optimizer, scheduler, config, train_it, 2))
        print_rank_0(f"checkpoint load | the loaded run trains on: {after * 1000:.0f} ms per iteration")
        return

    _steps(model, optimizer, scheduler, config, train_it, 2)  # warm-up
    base = statistics.median(_steps(model, optimizer, scheduler, config, train_it, 3))
    need = _check_disk(cli.save_dir, model, optimizer, scheduler)
    disk = disk_write_bandwidth(cli.save_dir + ".ddtest", cli.disk_gib)
    shutil.rmtree(cli.save_dir + ".ddtest", ignore_errors=True) if rank == 0 else None
    result.update(expected_gb=need / 1e9, disk_write_gbps=disk, step_s=base)
    print_rank_0(f"checkpoint disk | {cli.save_dir}: sequential write {disk:.2f} GB/s (aggregate of {world} "
                 f"rank(s), {cli.disk_gib:g} GiB each, fsync) | expected checkpoint {need / 1e9:.1f} GB")

    size = need / 1e9  # the async line's GB/s until the synchronous save measures the size on disk
    if not cli.no_sync:
        _sync()
        _barrier()
        t0 = time.perf_counter()
        save_checkpoint(1, model, optimizer, scheduler, 0)
        sync_s = _max_over_ranks(time.perf_counter() - t0)
        size = _dir_bytes(os.path.join(cli.save_dir, "iter_0000001")) / 1e9 if rank == 0 else 0.0
        size = _max_over_ranks(size)
        _sync()
        _barrier()
        held = _memory_mark()
        t0 = time.perf_counter()
        load_checkpoint(model, optimizer, scheduler)
        _sync()
        load_s = _max_over_ranks(time.perf_counter() - t0)
        held_gb, peak_gb = _load_memory(held)
        _remove(cli.save_dir, 1)
        result.update(size_gb=size, sync_save_s=sync_s, sync_save_gbps=size / sync_s, load_s=load_s,
                      load_held_gb=held_gb, load_peak_gb=peak_gb)
        print_rank_0(f"checkpoint sync | {layout} | {size:.2f} GB | save {sync_s:.2f} s = {size / sync_s:.2f} GB/s "
                     f"({100 * size / sync_s / disk:.0f}% of the disk) | load {load_s:.2f} s (device memory "
                     f"{held_gb:.1f} GB held, {peak_gb:.1f} GB peak)")

    if not cli.no_anchor:
        d_blocked, d_async, d_sync, d_size = dcp_anchor(model, optimizer, scheduler, cli.save_dir + ".dcp")
        if rank == 0:
            shutil.rmtree(cli.save_dir + ".dcp", ignore_errors=True)
        result.update(dcp_async_blocked_s=d_blocked, dcp_async_total_s=d_async, dcp_save_s=d_sync,
                      dcp_size_gb=d_size)
        print_rank_0(f"checkpoint anchor (torch.distributed.checkpoint) | {d_size:.2f} GB | async_save blocked "
                     f"{d_blocked:.2f} s, done after {d_async:.2f} s = {d_size / d_async:.2f} GB/s | save "
                     f"{d_sync:.2f} s = {d_size / d_sync:.2f} GB/s")
    args.async_save = True
    if not cli.no_reserve:  # as the training loop does after its first step
        from megatron.training.async_utils import host_staging
        from megatron.training.checkpointing import reserve_async_save_buffers
        reserved = reserve_async_save_buffers(model, optimizer, scheduler, 1)
        thread = host_staging()._reserving
        reserving = _steps(model, optimizer, scheduler, config, train_it, 400,
                           until=lambda: thread is None or not thread.is_alive())
        reserve_s = _max_over_ranks(host_staging().reserve_s or 0.0)
        result.update(reserved_gb=_max_over_ranks(reserved / 1e9), reserve_s=reserve_s,
                      step_s_while_reserving=statistics.median(reserving))
        print_rank_0(f"checkpoint reserve | {_max_over_ranks(reserved / 1e9):.1f} GB of page-locked host buffers "
                     f"per rank in {reserve_s:.2f} s in the background | iteration {base * 1000:.0f} ms normally, "
                     f"{statistics.median(reserving) * 1000:.0f} ms while reserving ({len(reserving)} steps)")
    blocked, recorded, during, splits, copies = [], [], [], [], []
    for k in range(cli.async_saves):
        it = 2 + k
        _sync()
        _barrier()
        t0 = time.perf_counter()
        save_checkpoint(it, model, optimizer, scheduler, 0)
        local = time.perf_counter() - t0
        blocked.append(_max_over_ranks(local))
        splits.append(blocking_split(local, last_staging_stats()))
        during += _steps(model, optimizer, scheduler, config, train_it, 200, until_saved=True)
        maybe_finalize_async_save(blocking=True)
        recorded.append(_max_over_ranks(time.perf_counter() - t0))
        copies.append(_max_over_ranks(last_staging_stats().get("copy_s", 0.0)))
        if k < cli.async_saves - 1 or not cli.keep:
            _remove(cli.save_dir, it)
    args.async_save = False
    staged = [b / 1e9 for b in _per_rank(last_staging_stats().get("bytes", 0.0))]  # = each rank's host buffer
    staged_gb = max(staged)
    result.update(async_blocked_s=blocked, async_blocked_split_s=splits, async_device_copy_s=copies,
                  async_staged_gb_per_rank=staged, async_recorded_s=recorded,
                  step_s_during_async=statistics.median(during))
    print_rank_0(f"checkpoint async | blocked {', '.join(f'{b:.2f}' for b in blocked)} s "
                 f"({'; '.join(_split_text(s) for s in splits)}) | host buffers "
                 f"{' + '.join(f'{g:.1f}' for g in staged)} GB | device-to-host copy of {staged_gb:.1f} GB "
                 f"{', '.join(f'{c:.2f}' for c in copies)} s in the background | recorded after "
                 f"{', '.join(f'{r:.2f}' for r in recorded)} s = {size / max(recorded):.2f} GB/s | iteration "
                 f"{base * 1000:.0f} ms normally, {statistics.median(during) * 1000:.0f} ms while writing")

    _write(cli, result, rank)


SPLIT = ("alloc", "launch", "wait", "other")


def blocking_split(blocked_s, stats):
    """{alloc, launch, wait, other}: seconds of this rank's blocked time, each the max over ranks. alloc:
    allocating (and page-locking) the host buffers; launch: queuing the background copies; wait: copies
    training waited for; other: the rest of save_checkpoint."""
    local = {"alloc": stats.get("alloc_s", 0.0), "launch": stats.get("launch_s", 0.0),
             "wait": stats.get("sync_copy_s", 0.0)}
    local["other"] = max(0.0, blocked_s - sum(local.values()))
    return {k: _max_over_ranks(local[k]) for k in SPLIT}


def _split_text(split):
    return ", ".join(f"{k} {split[k]:.2f}" for k in SPLIT)


def _without_load(flags):
    """Flags with --load dropped (build the model fresh; the timed load_checkpoint sets args.load itself)."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
            continue
        if f == "--load":
            skip = True
            continue
        out.append(f)
    return out


def _write(cli, result, rank):
    if cli.results and rank == 0:
        with open(cli.results, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
