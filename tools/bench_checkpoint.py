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
Where the synchronous save loses time against the anchor: --profile-save runs it under cProfile on rank 0 and
prints the top functions and the wall-clock seconds of its phases (state dict, request, DCP write, publish),
lines starting `profile | `; --sync-repeat N saves synchronously N-1 more times after the anchor and
--anchor-first runs the anchor before it, telling the order of the writes (page cache, a disk that slows down
once filled) from the code path. --async-saves 0 measures the synchronous saves alone (no reservation, no async
save), so `--no-anchor --async-saves 0 --sync-repeat 3` fits a 10-minute call at 8B.
Checkpoints are deleted once measured (one ~100 GB Llama-3-8B checkpoint at a time must fit on the disk);
--keep leaves the last async one for a --load-only run. Rank 0 prints the lines and, with --results, appends
them as one JSON line.
"""
import argparse
import cProfile
import functools
import importlib
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import sysconfig
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


class _Phases:
    """Wall-clock seconds spent in chosen functions while it is active: each is wrapped where its callers look it
    up at call time (a module or class attribute) and put back on exit, so the product code is timed as it is."""

    def __init__(self, targets):
        self.targets = targets  # [(phase name, module name or (module name, class name), attribute)]
        self.seconds = {name: 0.0 for name, _, _ in targets}
        self.calls = {name: 0 for name, _, _ in targets}
        self._undo = []

    def __enter__(self):
        for name, where, attr in self.targets:
            try:
                owner = importlib.import_module(where) if isinstance(where, str) else \
                    getattr(importlib.import_module(where[0]), where[1])
                original = getattr(owner, attr)
            except (ImportError, AttributeError):  # another torch or a moved function: that phase reads n/a
                self.calls[name] = None
                continue
            own = attr in vars(owner)  # a class may inherit it: then delete the wrapper instead of restoring
            setattr(owner, attr, self._timed(name, original))
            self._undo.append((owner, attr, original if own else None))
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.total = time.perf_counter() - self.start
        for owner, attr, original in reversed(self._undo):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._undo = []

    def _timed(self, name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return timed


# The phases of save_checkpoint's torch_dist save (save.py -> serialization.save -> the request's dcp_write,
# then its finalize steps); "a/b" runs inside "a". "other" (printed) is the save's time outside the top ones.
SAVE_PHASES = [
    ("generate_state_dict", "megatron.training.checkpointing.state", "generate_state_dict"),
    ("dist_checkpointing.save", "megatron.core.dist_checkpointing", "save"),
    ("dist_checkpointing.save/to_write", "megatron.core.dist_checkpointing.serialization", "_to_write"),
    ("dist_checkpointing.save/check_sharding", "megatron.core.dist_checkpointing.serialization",
     "_check_sharding"),
    ("dist_checkpointing.save/prepare", "megatron.core.dist_checkpointing.serialization", "_prepare"),
    ("dist_checkpointing.save/write_common", "megatron.core.dist_checkpointing.serialization", "_write_common"),
    ("dcp_write", "megatron.core.dist_checkpointing.strategies.torch", "dcp_write"),
    ("dcp_write/write_data", ("torch.distributed.checkpoint.filesystem", "FileSystemWriter"), "write_data"),
    ("dcp_write/finish", ("torch.distributed.checkpoint.filesystem", "FileSystemWriter"), "finish"),
    ("publish_dir", "megatron.training.checkpointing.paths", "publish_dir"),
]


def _profiled_save(save):
    """Run ``save()`` with its phases timed on every rank and under cProfile on rank 0 (its main thread: DCP
    writes there with one writer thread). Returns (the _Phases, the cProfile or None)."""
    prof = cProfile.Profile() if _rank_world()[0] == 0 else None
    with _Phases(SAVE_PHASES) as phases:
        if prof is not None:
            prof.enable()
        try:
            save()
        finally:
            if prof is not None:
                prof.disable()
    return phases, prof


def _short_paths(text):
    """pstats text with the repository, site-packages and standard-library prefixes cut off its paths."""
    import torch
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prefixes = {root, os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__))),
                sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], sysconfig.get_paths()["stdlib"]}
    for prefix in sorted(prefixes, key=len, reverse=True):
        text = text.replace(prefix.rstrip(os.sep) + os.sep, "")
    return text


def _report_profile(phases, prof, rows=25):
    """Rank 0 prints the phase seconds (its own, then every rank's) and the cProfile top ``rows`` functions by
    tottime and by cumtime, each line starting with `profile | `. Collective (the phases are gathered)."""
    from megatron.training.utils import print_rank_0
    top = [n for n, _, _ in SAVE_PHASES if "/" not in n]
    mine = dict(phases.seconds, other=phases.total - sum(phases.seconds[n] for n in top), total=phases.total)
    ranks = _per_rank(mine)
    for name in [n for n, _, _ in SAVE_PHASES] + ["other", "total"]:
        calls = phases.calls.get(name, 1)
        if calls is None:
            print_rank_0(f"profile | phase {name} n/a (not found to time)")
            continue
        print_rank_0(f"profile | phase {name} {mine[name]:.3f}" + (f" ({calls} calls)" if calls != 1 else "")
                     + (f" (ranks {' '.join(f'{r[name]:.3f}' for r in ranks)})" if len(ranks) > 1 else ""))
    if prof is None:
        return
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(rows)
        lines = [line for line in _short_paths(out.getvalue()).splitlines() if line.strip()]
        print(f"profile | top {rows} by {key} (rank 0, cProfile of the main thread)", flush=True)
        for line in lines:
            print(f"profile | {line}", flush=True)


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
    p.add_argument("--async-saves", type=int, default=2,
                   help="background saves measured one after another (0: none, and no reservation)")
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
    p.add_argument("--profile-save", action="store_true",
                   help="run the synchronous save under cProfile on rank 0 and print its top functions and the "
                        "wall-clock seconds of its phases ('profile | ' lines; its save time includes cProfile's "
                        "overhead, --sync-repeat times it without)")
    p.add_argument("--sync-repeat", type=int, default=1,
                   help="synchronous saves in all: the others after the anchor, each into its own iteration "
                        "directory, deleted once measured")
    p.add_argument("--anchor-first", action="store_true", help="run the anchor before the synchronous save")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    cli = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if cli.sync_repeat < 1:
        p.error("--sync-repeat must be at least 1")
    if cli.async_saves < 0 or (cli.async_saves == 0 and (cli.no_sync or cli.keep)):
        p.error("--async-saves must be >= 0, and 0 measures the synchronous saves (not with --no-sync or --keep)")
    if cli.no_sync and (cli.profile_save or cli.sync_repeat > 1):
        p.error("--profile-save and --sync-repeat measure the synchronous save; drop --no-sync")
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

    def sync_save(iteration, around=lambda save: save()):
        """(max seconds over ranks, GB on disk) of one synchronous save_checkpoint at ``iteration`` (run as
        ``around(save)``)."""
        _sync()
        _barrier()
        t0 = time.perf_counter()
        around(lambda: save_checkpoint(iteration, model, optimizer, scheduler, 0))
        seconds = _max_over_ranks(time.perf_counter() - t0)
        gb = _dir_bytes(os.path.join(cli.save_dir, f"iter_{iteration:07d}")) / 1e9 if rank == 0 else 0.0
        return seconds, _max_over_ranks(gb)

    def anchor():
        d_blocked, d_async, d_sync, d_size = dcp_anchor(model, optimizer, scheduler, cli.save_dir + ".dcp")
        if rank == 0:
            shutil.rmtree(cli.save_dir + ".dcp", ignore_errors=True)
        result.update(dcp_async_blocked_s=d_blocked, dcp_async_total_s=d_async, dcp_save_s=d_sync,
                      dcp_size_gb=d_size)
        print_rank_0(f"checkpoint anchor (torch.distributed.checkpoint) | {d_size:.2f} GB | async_save blocked "
                     f"{d_blocked:.2f} s, done after {d_async:.2f} s = {d_size / d_async:.2f} GB/s | save "
                     f"{d_sync:.2f} s = {d_size / d_sync:.2f} GB/s")

    if cli.anchor_first and not cli.no_anchor:
        anchor()
    size = need / 1e9  # the async line's GB/s until the synchronous save measures the size on disk
    if not cli.no_sync:
        profiled = []  # --profile-save: (phases, cProfile) of this save, reported after its line
        sync_s, size = sync_save(1, around=lambda save: profiled.append(_profiled_save(save))) \
            if cli.profile_save else sync_save(1)
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
        if profiled:
            _report_profile(*profiled[0])

    if not cli.no_anchor and not cli.anchor_first:
        anchor()
    if not cli.no_sync and cli.sync_repeat > 1:
        # The same save again, after the anchor: a time that drops to the anchor's comes from the order of the
        # writes (page cache, a disk slowing as it fills), not from the code path. Iterations clear of the
        # async saves' 2, 3, ...
        again = []
        for k in range(cli.sync_repeat - 1):
            it = max(100, 2 + cli.async_saves) + k
            again.append(sync_save(it))
            _remove(cli.save_dir, it)
            print_rank_0(f"checkpoint sync again | save {again[-1][0]:.2f} s = {again[-1][1] / again[-1][0]:.2f} GB/s")
        result.update(sync_again_s=[a[0] for a in again])
    if cli.async_saves == 0:  # the synchronous saves only (e.g. --sync-repeat runs that must fit a time limit)
        _write(cli, result, rank)
        return
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
