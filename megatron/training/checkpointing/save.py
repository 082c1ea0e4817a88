"""save_checkpoint: write to a staging directory, agree on success, then publish and point the tracker.

Order on disk: data files -> `metadata.json` (torch_dist) -> barrier -> rename `iter_N.tmp` to `iter_N`
-> tracker (atomic rename). A process killed at any point leaves the previous checkpoint and tracker intact.
"""
import os
import shutil
import time

import torch

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing import CheckpointingException
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.optimizer import megatron_format
from megatron.training import async_utils, progress_log
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0

from . import paths, state


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
                    pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
                    train_data_iterator=None, preprocess_common_state_dict_fn=None):
    """Save model, optimizer, scheduler, RNG and counters of ``iteration`` under ``args.save`` (with
    ``non_persistent_ckpt``: in the non-persistent directory, where only the newest save is kept).
    A save that fails (rather than being killed) removes its staging directory before the error goes on."""
    save_dir = _save_dir(get_args(), non_persistent_ckpt)
    try:
        _save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                         non_persistent_ckpt, preprocess_common_state_dict_fn)
    except BaseException as e:
        if _rank() == 0 and save_dir:
            final_dir = paths.get_checkpoint_name(save_dir, iteration, return_base_dir=True)
            shutil.rmtree(paths.staging_dir(final_dir), ignore_errors=True)
        if isinstance(e, OSError) and save_dir:  # a full disk, a lost mount: one line that says what is kept
            latest = paths.latest_iteration(save_dir)
            kept = f"iteration {latest} stays the latest checkpoint" if latest is not None else \
                "there is no earlier checkpoint"
            raise CheckpointingException(f"saving the checkpoint of iteration {iteration} to {save_dir} failed: {e}; "
                                         f"{kept} (free space there or pass another --save)") from e
        raise


def _save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                     non_persistent_ckpt, preprocess_common_state_dict_fn):
    args = get_args()
    model = model if isinstance(model, list) else [model]
    fmt = args.ckpt_format
    if args.async_save and fmt != "torch_dist":
        raise NotImplementedError(f"--async-save needs --ckpt-format torch_dist (got {fmt})")
    if args.async_save and not async_utils.is_empty_async_queue():
        # Publish the pending save first: at most one background write (and host copy) at a time, and
        # checkpoints are recorded in iteration order. The queue length is the same on every rank (it only
        # shrinks on all-reduced flags), so all ranks take this collective branch together.
        print_rank_0("WARNING: Starting a checkpoint save before previous has finished. "
                     "Consider increasing the checkpoint interval.")
        async_utils.maybe_finalize_async_save(blocking=True)
    save_dir = _save_dir(args, non_persistent_ckpt)
    kind = "non-persistent checkpoint" if non_persistent_ckpt else "checkpoint"
    print_rank_0(f"saving {kind} at iteration {iteration:7d} to {save_dir} in {fmt} format")
    start = time.time()
    final_dir = paths.get_checkpoint_name(save_dir, iteration, return_base_dir=True)
    tmp_dir = paths.staging_dir(final_dir)
    if _rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # leftover of a killed save
        os.makedirs(tmp_dir)
    _barrier()
    paths.fault_point("staging_created", iteration)
    _finish_param_gathers(model)
    rng = state.get_rng_state() if not args.no_save_rng else None
    sd = state.generate_state_dict(args, model, optimizer, opt_param_scheduler, rng, iteration,
                                   num_floating_point_operations_so_far, sharded=fmt == "torch_dist",
                                   save_optim=not args.no_save_optim, save_rng=not args.no_save_rng)
    if preprocess_common_state_dict_fn is not None and fmt == "torch_dist":
        sd = preprocess_common_state_dict_fn(sd)
    finalize = _finalize_fn(save_dir, iteration, tmp_dir, final_dir, start, non_persistent_ckpt)
    if fmt == "torch_dist":
        staging = async_utils.host_staging(reuse=getattr(args, "async_save_pinned_buffers", True)) \
            if args.async_save else None
        # A synchronous save runs the request right away, before training changes anything: it writes from the
        # device tensors (copied to the host as they are written) instead of copying everything to the host first.
        kwargs = dict(sharded_strategy=_save_strategy(args), async_sharded_save=True,
                      verify_integrity=getattr(args, "verify_integrity", False),
                      host_staging=staging, defer_host_copy=not args.async_save)
        if getattr(args, "ckpt_save_megatron_layout", False):
            request = _save_megatron_layout(sd, tmp_dir, args, **kwargs)
        else:
            request = dist_checkpointing.save(sd, tmp_dir, **kwargs)
        write = request.async_fn

        def write_shards(*a, **kw):
            write(*a, **kw)
            paths.fault_point("writing", iteration, tmp_dir)  # the last write of a full disk fails

        request.async_fn = write_shards
        request.finalize_fns.insert(0, lambda: paths.fault_point("data_written", iteration))
        request.finalize_fns.append(finalize)
        if args.async_save:
            async_utils.schedule_async_save(request)
            print_rank_0(f"  scheduled an async checkpoint save at iteration {iteration:7d} "
                         f"(blocked {time.time() - start:.3f}s{_staging_report(staging)})")
            return
        request.async_fn(group=None)
        for fn in request.finalize_fns:
            fn()
    elif fmt == "torch":
        _save_legacy(sd, tmp_dir, save_dir, iteration, args)
        paths.fault_point("data_written", iteration)
        finalize()
    else:
        raise ValueError(f"--ckpt-format {fmt} is not supported; use torch_dist or torch")


def reserve_async_save_buffers(model, optimizer, opt_param_scheduler, iteration) -> int:
    """Start allocating the page-locked host buffers of --async-save in the background, sized as the first save
    will stage (collective: every rank calls it at the same iteration), so that save waits only for its copy's
    launch instead of tens of seconds of allocation. Returns the bytes reserved on this rank (0: nothing to do:
    not an async torch_dist save, --no-async-save-pinned-buffers, or no CUDA; or not enough host memory for this
    node's ranks, said in one warning line)."""
    args = get_args()
    if not (args.async_save and args.ckpt_format == "torch_dist" and args.save and torch.cuda.is_available()
            and getattr(args, "async_save_pinned_buffers", True)):
        return 0
    model = model if isinstance(model, list) else [model]
    rng = state.get_rng_state() if not args.no_save_rng else None  # as the save builds it (collective)
    sd = state.generate_state_dict(args, model, optimizer, opt_param_scheduler, rng, iteration,
                                   getattr(args, "num_floating_point_operations_so_far", 0), sharded=True,
                                   save_optim=not args.no_save_optim, save_rng=not args.no_save_rng)
    # 1 MiB over: a reservation smaller than the save's state is given back, and the save allocates after all.
    nbytes = dist_checkpointing.staged_bytes(sd, sharded_strategy=_save_strategy(args)) + (1 << 20)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = _host_memory_available()
    if available is not None and nbytes * local_ranks > 0.8 * available:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"WARNING: --async-save keeps {nbytes / 1e9:.1f} GB of page-locked host memory per rank "
                  f"({nbytes * local_ranks / 1e9:.1f} GB for this node's {local_ranks} ranks) but "
                  f"{available / 1e9:.1f} GB are available: the first save may run out of host memory; pass "
                  f"--no-async-save-pinned-buffers (pageable buffers, freed after each write) or use more nodes. "
                  f"The buffers are not reserved ahead of the first save.", flush=True)
        return 0
    async_utils.host_staging().reserve(nbytes)
    return nbytes


def _host_memory_available():
    """Bytes of host memory available now (MemAvailable), or None where /proc/meminfo is not readable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _save_strategy(args):
    """Spread the writes of DP-replicated tensors over the DP (x CP) group unless --no-ckpt-fully-parallel-save."""
    if not getattr(args, "ckpt_fully_parallel_save", True) or not ps.model_parallel_is_initialized():
        return None
    return FullyParallelSaveStrategyWrapper(None, ps.get_data_parallel_group(with_context_parallel=True))


def _finish_param_gathers(model) -> None:
    """Wait for param all-gathers still in flight (--overlap-param-gather launches them after the optimizer
    step and waits in the next forward): the saved weights are the gathered ones."""
    for chunk in model:
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()


def _staging_report(staging) -> str:
    """The host-copy part of the blocked time, e.g. '; host copy: 0.021s to queue 52.1 GB'."""
    st = staging.stats if staging is not None else {}
    parts = [f"{st[key]:.3f}s {what}" for key, what in (("launch_s", "to queue"), ("sync_copy_s", "copying"),
                                                         ("alloc_s", "allocating host buffers")) if st.get(key)]
    return f"; host copy of {st['bytes'] / 1e9:.2f} GB: {', '.join(parts)}" if parts else ""


def _save_megatron_layout(sd, tmp_dir, args, **kwargs):
    """--ckpt-save-megatron-layout: the same state in Megatron-LM's torch_dist layout (stacked layers, its
    distributed optimizer's fully_reshardable state, its content metadata), which Megatron-LM --load resumes
    from (with --use-distributed-optimizer when the optimizer is saved) and this project loads as well."""
    if "optimizer" in sd:
        # Megatron's Transformer Engine spec gives expert params their own (chained) optimizer; its local spec not.
        te_spec = getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"
        sd["optimizer"] = megatron_format.to_megatron(sd["optimizer"], expert_optimizer=te_spec,
                                                      model_sharded_sd=state.merged_model_sharded_sd(sd))
    return dist_checkpointing.save_in_megatron_layout(
        sd, tmp_dir, args.num_layers, getattr(args, "num_experts", None),
        content_metadata=dict(megatron_format.CONTENT_METADATA) if "optimizer" in sd else None, **kwargs)


def _save_legacy(sd, tmp_dir, save_dir, iteration, args) -> None:
    """One pickled file per model-parallel rank, written by data-parallel rank 0."""
    if getattr(args, "use_distributed_optimizer", False) and not args.no_save_optim:
        raise NotImplementedError("--ckpt-format torch with --use-distributed-optimizer is not supported; "
                                  "use --ckpt-format torch_dist")
    if state.layout()["dp"] != 0:
        return
    final_name = paths.get_checkpoint_name(save_dir, iteration)
    name = os.path.join(tmp_dir, os.path.relpath(final_name, paths.get_checkpoint_name(
        save_dir, iteration, return_base_dir=True)))
    os.makedirs(os.path.dirname(name), exist_ok=True)
    torch.save(sd, name + ".tmp")
    os.replace(name + ".tmp", name)


def _save_dir(args, non_persistent: bool) -> str:
    if not non_persistent:
        return args.save
    if getattr(args, "non_persistent_ckpt_type", None) != "global":
        raise NotImplementedError(f"non-persistent checkpoints of type {args.non_persistent_ckpt_type} are not "
                                  "built; pass --non-persistent-ckpt-type global")
    return paths.non_persistent_dir(args, args.save)


def _finalize_fn(save_dir, iteration, tmp_dir, final_dir, start, non_persistent=False):
    """Runs on every rank once all ranks wrote their part: publish, update the tracker, report (a non-persistent
    save then deletes the older ones)."""
    def finalize():
        _barrier()
        if _rank() == 0:
            paths.fault_point("before_publish", iteration)
            paths.publish_dir(tmp_dir, final_dir)
            paths.fault_point("published", iteration)
            paths.write_tracker(save_dir, iteration)
            if non_persistent:
                paths.drop_older(save_dir, iteration)
            else:
                paths.apply_retention(save_dir, iteration, getattr(get_args(), "save_retain_interval", None))
            if getattr(get_args(), "async_save", False):
                progress_log.async_checkpoint_recorded(get_args(), iteration)  # --log-progress
        _barrier()
        lay = state.layout()
        print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {save_dir} "
                     f"[ t {lay['tp'] + 1}/{lay['tp_size']}, p {lay['pp'] + 1}/{lay['pp_size']} ] "
                     f"({time.time() - start:.2f}s)")
    return finalize
