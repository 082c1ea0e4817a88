"""load_checkpoint: find the checkpoint, check it fits this run, restore model/optimizer/scheduler/RNG."""
import os
import sys
from typing import Any, Dict, Optional, Tuple

import torch

from megatron.core import dist_checkpointing
from megatron.core import num_microbatches_calculator as mbc
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing import CheckpointingException
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from megatron.core.optimizer import megatron_dp_reshardable as dp_resh
from megatron.core.optimizer import megatron_format
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import unwrap_model
from megatron.training.global_vars import get_args, update_num_microbatches
from megatron.training.utils import print_rank_0

from . import paths, state

# (args field, flag) that must match between the checkpoint and this run (COMPAT 6.3).
ARCH_ARGS = [("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
             ("num_attention_heads", "--num-attention-heads"),
             ("add_position_embedding", "--no-position-embedding"),
             ("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by"),
             ("tokenizer_type", "--tokenizer-type")]
LEGACY_ARGS = [("padded_vocab_size", "the padded vocab size"),
               ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
               ("pipeline_model_parallel_size", "--pipeline-model-parallel-size")]


def _find(load_dir: str, args) -> Optional[Tuple[int, bool]]:
    """(iteration, release) to load, or None when ``load_dir`` has no checkpoint."""
    if args.ckpt_step is not None:
        return args.ckpt_step, False
    tracker = paths.get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        return None
    return paths.read_metadata(tracker)


def _newer_non_persistent(load_dir, found, args):
    """(directory, (iteration, release)) to load: the non-persistent checkpoint when it is at least as new as
    the one under --load (Megatron's rule), else --load's. Not with --ckpt-step (it names a persistent save)."""
    if getattr(args, "non_persistent_ckpt_type", None) != "global" or args.ckpt_step is not None:
        return load_dir, found
    np_dir = paths.non_persistent_dir(args, load_dir)
    np_found = _find(np_dir, args) if np_dir else None
    if np_found is None:
        return load_dir, found
    if found is not None and np_found[0] < found[0]:
        print_rank_0(f"WARNING: the non-persistent checkpoint (iteration {np_found[0]}) is older than the one under "
                     f"--load (iteration {found[0]}); loading the latter")
        return load_dir, found
    print_rank_0(f" loading the non-persistent checkpoint of iteration {np_found[0]} from {np_dir}")
    return np_dir, np_found


def check_checkpoint_args(ckpt_args, args, ckpt_format: str, checkpoint_dir: str) -> None:
    """Raise one line naming every architecture flag that differs from the checkpoint's. Saved args may
    predate a flag, and library-style callers (set_args with their own namespace) need not carry every
    flag: both are read with getattr, here and in the save/load helpers."""
    checks = ARCH_ARGS + (LEGACY_ARGS if ckpt_format == "torch" else [])
    if getattr(args, "vocab_file", None):
        checks = checks + [("max_position_embeddings", "--max-position-embeddings")]
    diffs = []
    for name, flag in checks:
        saved, current = getattr(ckpt_args, name, None), getattr(args, name, None)
        if saved is not None and current is not None and saved != current:
            diffs.append(f"{flag}: checkpoint {saved}, this run {current}")
    if diffs:
        raise ValueError(f"checkpoint {checkpoint_dir} does not match this run ({'; '.join(diffs)}); "
                         f"pass the checkpoint's values or use --finetune / --use-checkpoint-args")


def _read_legacy(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        raise CheckpointingException(f"checkpoint file {path} is missing (saved under another TP/PP layout? "
                                     f"convert it with tools/checkpoint/convert.py)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointingException(f"corrupted checkpoint file {path}: {type(e).__name__}: {e}") from e


def _detect(checkpoint_dir: str, args) -> str:
    found = paths.detect_format(checkpoint_dir)
    if found is None:
        raise CheckpointingException(f"{checkpoint_dir} holds no complete checkpoint (no metadata.json, no mp_rank_*)")
    if found != args.ckpt_format and not args.auto_detect_ckpt_format:
        raise ValueError(f"checkpoint {checkpoint_dir} is in {found} format; pass --ckpt-format {found} "
                         f"or --auto-detect-ckpt-format")
    return found


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg: str = "load", strict: bool = True,
                    checkpointing_context=None, skip_load_to_model_and_opt: bool = False):
    """Restore the latest (or ``--ckpt-step``) checkpoint; returns (iteration, FLOPs so far).
    Also restores ``args.consumed_train_samples`` / ``consumed_valid_samples``."""
    args = get_args()
    model = model if isinstance(model, list) else [model]
    load_dir = getattr(args, load_arg)
    finetune = args.finetune
    found = _find(load_dir, args) if load_dir else None
    if load_arg == "load":
        load_dir, found = _newer_non_persistent(load_dir, found, args)
    if found is None and args.pretrained_checkpoint and load_arg == "load":
        # Megatron's fine-tuning start: nothing saved under --load yet, so load the weights only
        print_rank_0(f" no checkpoint under --load {load_dir}; fine-tuning from --pretrained-checkpoint "
                     f"{args.pretrained_checkpoint}")
        load_dir, finetune = args.pretrained_checkpoint, True
        found = _find(load_dir, args)
        if found is None:
            raise FileNotFoundError(f"--pretrained-checkpoint {load_dir}: no checkpoint found (no "
                                    f"{paths.get_checkpoint_tracker_filename(load_dir)})")
    if found is None:
        where = paths.get_checkpoint_tracker_filename(load_dir) if load_dir else "(no --load)"
        if args.exit_on_missing_checkpoint:
            # Megatron's wording and exit status: a launcher or CI harness sees the missing checkpoint as a failure.
            print_rank_0(f">> '--exit-on-missing-checkpoint' is set but no checkpoint was found under load directory "
                         f"'{load_dir}' (missing metadata/tracker file '{where}'). Exiting with a non-zero status. <<")
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            sys.exit(1)
        if load_dir:
            print_rank_0(f"WARNING: could not find the metadata file {where}\n"
                         f"    will not load any checkpoints and will start from random")
        return 0, 0
    iteration, release = found
    skip_state = finetune or release
    iteration, (fmt, checkpoint_dir, ckpt) = _read_with_fallback(load_dir, iteration, release, model, optimizer,
                                                                args, skip_state)
    ckpt_args = ckpt.get("args")
    if not skip_state and ckpt_args is not None:
        check_checkpoint_args(ckpt_args, args, fmt, checkpoint_dir)
    main_params = ckpt.pop("megatron_main_params", None)
    if not skip_load_to_model_and_opt:
        _restore_model(ckpt, model, strict)
        if main_params:  # Megatron's dp_reshardable slices: the main params must be the weights just loaded
            dp_resh.check_main_params(main_params, optimizer._sharded_key_to_param, load_dir)
    if not skip_state:
        _restore_training_state(ckpt, optimizer, opt_param_scheduler, args)
    if (optimizer is not None and not skip_load_to_model_and_opt
            and (skip_state or args.no_load_optim or "optimizer" not in ckpt)):
        optimizer.reload_model_params()  # fp32 main params (bf16/fp16, distributed optimizer) from the weights
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    lay = state.layout()
    print_rank_0(f"  successfully loaded checkpoint from {load_dir} [ t {lay['tp'] + 1}/{lay['tp_size']}, "
                 f"p {lay['pp'] + 1}/{lay['pp_size']} ] at iteration {0 if skip_state else iteration}")
    result = (0, 0) if skip_state else (ckpt.get("iteration", iteration),
                                        ckpt.get("num_floating_point_operations_so_far", 0))
    del ckpt, main_params
    if torch.cuda.is_available():
        # The read buffers the load made (a vocabulary saved at another size, fp32 main params without an fp32
        # gradient buffer to read into) stay cached in torch's allocator once freed; NCCL and cuBLAS allocate
        # outside it, and at 8B scale their first buffers after a load (a pipeline's first send) found the
        # device full.
        torch.cuda.empty_cache()
    return result


def _read(load_dir, iteration, release, model, optimizer, args, skip_state):
    """(format, directory, loaded state) of one checkpoint; every rank raises if any rank could not read it."""
    checkpoint_dir = paths.get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    if args.ckpt_step is not None and not os.path.isdir(checkpoint_dir):
        raise ValueError(f"--ckpt-step {iteration}: {checkpoint_dir} does not exist")
    error, result = None, None
    try:
        fmt = _detect(checkpoint_dir, args)
        print_rank_0(f" loading checkpoint from {load_dir} at iteration {iteration}")
        result = fmt, checkpoint_dir, _load_state(fmt, checkpoint_dir, load_dir, iteration, release, model,
                                                  optimizer, args, skip_state)
    except CheckpointingException as e:
        error = e
    # Legacy files are read per rank: ranks must agree before any of them falls back to another iteration.
    if _failed_on_any_rank(error is not None):
        raise error or CheckpointingException(f"checkpoint {checkpoint_dir} could not be read on another rank "
                                              f"(its error names the file)")
    return result


def _failed_on_any_rank(failed: bool) -> bool:
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return failed
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(failed)], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def _read_with_fallback(load_dir, iteration, release, model, optimizer, args, skip_state):
    """(iteration, _read(...)): the latest checkpoint, or with --ckpt-fallback-to-previous the newest older
    complete one that reads, when the latest is unreadable (truncated, corrupt, incomplete)."""
    try:
        return iteration, _read(load_dir, iteration, release, model, optimizer, args, skip_state)
    except CheckpointingException as e:
        error = e
    older = [] if (release or args.ckpt_step is not None) else paths.previous_complete(load_dir, iteration)
    if not older:
        raise error
    if not getattr(args, "ckpt_fallback_to_previous", False):
        raise CheckpointingException(f"{error}; pass --ckpt-fallback-to-previous to load iteration {older[0]} "
                                     f"instead") from error
    failed = iteration
    for previous in older:
        print_rank_0(f"WARNING: the checkpoint of iteration {failed} cannot be loaded ({error}); "
                     f"--ckpt-fallback-to-previous: loading iteration {previous} instead")
        try:
            return previous, _read(load_dir, previous, False, model, optimizer, args, skip_state)
        except CheckpointingException as e:
            error, failed = e, previous
    raise CheckpointingException(f"no checkpoint under {load_dir} can be loaded; the oldest tried, iteration "
                                 f"{failed}: {error}") from error


def _load_state(fmt, checkpoint_dir, load_dir, iteration, release, model, optimizer, args, skip_state):
    if fmt == "torch":
        return _read_legacy(paths.get_checkpoint_name(load_dir, iteration, release))
    common = dist_checkpointing.load_common_state_dict(checkpoint_dir)
    ckpt_args = common.get("args")
    if not skip_state and ckpt_args is not None:
        check_checkpoint_args(ckpt_args, args, fmt, checkpoint_dir)
    load_optim = (not skip_state and not args.no_load_optim and optimizer is not None
                  and not getattr(ckpt_args, "no_save_optim", False))
    load_rng = not skip_state and not args.no_load_rng and not getattr(ckpt_args, "no_save_rng", False)
    if not skip_state and getattr(args, "fp8", None):
        _refuse_fp8_scaling_state(checkpoint_dir)
    lay = state.layout()
    if load_rng and ckpt_args is not None and (
            getattr(ckpt_args, "tensor_model_parallel_size", 1) != lay["tp_size"]
            or getattr(ckpt_args, "pipeline_model_parallel_size", 1) != lay["pp_size"]):
        print_rank_0("WARNING: the checkpoint's TP/PP layout differs from this run; RNG state is not loaded")
        load_rng = False
    sd = state.generate_state_dict(args, model, optimizer, None, state.get_rng_state(), 0, 0, sharded=True,
                                   is_loading=True, save_optim=load_optim, save_rng=load_rng)
    if load_optim and isinstance(common.get("optimizer"), dict):
        megatron_format.check_sharding_type(common["optimizer"], checkpoint_dir)
    dp_reshardable = load_optim and megatron_format.sharding_type(common.get("optimizer")) == dp_resh.SHARDING_TYPE
    megatron_optim = load_optim and megatron_format.is_megatron_optimizer_state(common.get("optimizer"))
    our_optim_request = None
    if dp_reshardable:  # Megatron-LM's flat bucket shards: read whole, sliced per param after loading
        our_optim_request = sd["optimizer"]
        sd["optimizer"] = _dp_reshardable_request(checkpoint_dir, ckpt_args, optimizer, model)
        print_rank_0(f" loading Megatron-LM's optimizer state ({dp_resh.SHARDING_TYPE})")
    elif megatron_optim:  # a Megatron-LM training checkpoint: its optimizer state names
        kind = megatron_format.sharding_type(common["optimizer"])
        if kind is not None:
            sd["optimizer"] = megatron_format.rename_state_keys(sd["optimizer"])
        print_rank_0(f" loading Megatron-LM's optimizer state ({kind or 'non-distributed optimizer'})")
    for k in ("args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far"):
        sd.pop(k, None)
    strict = getattr(args, "dist_ckpt_strictness", "assume_ok_unexpected")
    loaded = dist_checkpointing.load(sd, checkpoint_dir, sharded_strategy=_load_strategy(args), strict=strict,
                                     verify_integrity=getattr(args, "verify_integrity", False))
    if dp_reshardable:
        loaded["optimizer"], loaded["megatron_main_params"] = _from_dp_reshardable(
            loaded["optimizer"], our_optim_request, optimizer, model)
    elif megatron_optim:
        loaded["optimizer"] = megatron_format.to_our_state(loaded["optimizer"], optimizer.param_groups)
    if not load_optim:
        loaded.pop("optimizer", None)
        if skip_state:
            loaded.pop("opt_param_scheduler", None)
    if not load_rng:
        loaded.pop("rng_state", None)
    if "rerun_state_machine" in common:
        loaded["rerun_state_machine"] = common["rerun_state_machine"]
    return loaded


def _dp_reshardable_request(checkpoint_dir, ckpt_args, optimizer, model):
    """The load request for Megatron's dp_reshardable optimizer state of this rank's model-parallel rank (its
    ``dp_group_idx``: pp rank * TP size + TP rank), which only this run's TP/PP layout can read."""
    saved = tuple(getattr(ckpt_args, f, None) or 1 for f in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"))
    lay = state.layout()
    ours = (lay["tp_size"], lay["pp_size"], len(model) if len(model) > 1 else 1)
    if saved != ours:
        raise ValueError(f"checkpoint {checkpoint_dir}: Megatron-LM's dp_reshardable optimizer state was saved at "
                         f"TP/PP/VPP {saved} and reads only at that layout (this run: {ours}); pass the "
                         f"checkpoint's --tensor-model-parallel-size / --pipeline-model-parallel-size, resume with "
                         f"--no-load-optim, or re-save it from Megatron-LM with --dist-ckpt-optim-fully-reshardable")
    if hasattr(optimizer, "chained_optimizers") or any(g.get("is_expert_parallel") for g in optimizer.param_groups):
        raise ValueError(f"checkpoint {checkpoint_dir}: Megatron-LM's dp_reshardable optimizer state is read here only "
                         f"into one Adam optimizer of a model without experts; resume with --no-load-optim, or "
                         f"re-save it from Megatron-LM with --dist-ckpt-optim-fully-reshardable")
    objects = {k.split("/shard_")[0] for k in dist_checkpointing.load_sharded_metadata(checkpoint_dir)}
    return dp_resh.request(dist_checkpointing.load_tensors_metadata(checkpoint_dir), objects,
                           lay["pp"] * lay["tp_size"] + lay["tp"], checkpoint_dir)


def _from_dp_reshardable(loaded, our_request, optimizer, model):
    """(our optimizer state, {key: Megatron's fp32 main param}) from the loaded dp_reshardable entries."""
    param_state, main = dp_resh.to_our_state(loaded, our_request, optimizer._sharded_key_to_param,
                                             [unwrap_model(c) for c in model], megatron_format.STATE_NAMES)
    out = megatron_format.to_our_state({"optimizer": loaded["optimizer"]}, optimizer.param_groups)
    if "grad_scaler" in loaded:
        out["grad_scaler"] = loaded["grad_scaler"]
    out["param_state"] = param_state
    return out, main


def _refuse_fp8_scaling_state(checkpoint_dir: str) -> None:
    """An --fp8 resume of a checkpoint whose Transformer Engine modules saved delayed-scaling FP8 state (Megatron-LM
    --fp8-format with its default --fp8-recipe delayed): our FP8 recomputes tensorwise scales every step, so
    that state would silently not be continued; one line instead."""
    key = dist_checkpointing.fp8_extra_state_key(checkpoint_dir)
    if key is not None:
        raise ValueError(f"checkpoint {checkpoint_dir}: {key} holds Transformer Engine FP8 scaling state (scales, "
                         f"amax history) that cannot be honoured here (our FP8 recomputes tensorwise scales every "
                         f"step); resume without --fp8-format (bf16), or start a new run from its weights with "
                         f"--finetune")


def _restore_model(ckpt, model, strict: bool) -> None:
    for i, chunk in enumerate(model):
        key = "model" if len(model) == 1 else f"model{i}"
        if key not in ckpt:
            raise CheckpointingException(f"checkpoint has no '{key}' state (saved with another "
                                         f"--num-layers-per-virtual-pipeline-stage?)")
        unwrap_model(chunk).load_state_dict(ckpt[key], strict=strict)


def _restore_training_state(ckpt, optimizer, opt_param_scheduler, args) -> None:
    ckpt_args = ckpt.get("args")
    if ckpt_args is not None:
        args.consumed_train_samples = getattr(ckpt_args, "consumed_train_samples", 0)
        args.consumed_valid_samples = getattr(ckpt_args, "consumed_valid_samples", 0)
        args.skipped_train_samples = getattr(ckpt_args, "skipped_train_samples", 0)
        if mbc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:  # unset in library-style use
            update_num_microbatches(consumed_samples=args.consumed_train_samples, consistency_check=False)
    if optimizer is not None and not args.no_load_optim and "optimizer" in ckpt:
        optimizer.load_state_dict(ckpt["optimizer"])
        if opt_param_scheduler is not None and "opt_param_scheduler" in ckpt:
            opt_param_scheduler.load_state_dict(ckpt["opt_param_scheduler"])
    if ckpt.get("rerun_state_machine") is not None:
        get_rerun_state_machine().load_state_dict(ckpt["rerun_state_machine"])
    if not args.no_load_rng and ckpt.get("rng_state") is not None:
        rng = ckpt["rng_state"]
        state.set_rng_state(rng[0] if isinstance(rng, list) else rng)


def _load_strategy(args):
    """Read each DP-replicated weight once over the DP (x CP) group with --ckpt-fully-parallel-load."""
    if not getattr(args, "ckpt_fully_parallel_load", False) or not ps.model_parallel_is_initialized():
        return None
    return FullyParallelLoadStrategyWrapper(None, ps.get_data_parallel_group(with_context_parallel=True))
