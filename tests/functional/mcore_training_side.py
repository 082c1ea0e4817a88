"""Megatron Core's side of tests/functional/test_megatron_training_checkpoints.py: a small Megatron training run
(its GPTModel with the local spec, its DistributedDataParallel, get_megatron_optimizer and OptimizerParamScheduler;
CPU, gloo, fp32) that saves and resumes Megatron-LM *training* checkpoints the way megatron/training/checkpointing.py
does (tracker file, ``iter_{:07d}``, the state dict of its ``generate_state_dict``, the sharded-state-dict
metadata of ``_build_sharded_state_dict_metadata`` as content metadata). Run in a subprocess whose sys.path starts
with the megatron-core 0.19.2 wheel's files (see mcore_checkpoint_side.py, whose CPU patches it reuses).

    python mcore_training_side.py JOB_JSON

The job holds ``ranks``, ``tp``, ``batches``, ``flags_tsv`` and a list of ``runs`` (each: ``mode``, ``model``,
``args``, ``ckpt_dir``, ``out``, optionally its own ``tp``...), run one after another on the same ranks, so one
interpreter start serves several models. Mode ``train`` trains ``save_at`` iterations, saves, and trains on to
``train_iters``; ``resume`` loads the latest checkpoint under ``ckpt_dir`` (its RNG state only when saved at this
TP/PP layout, as Megatron-LM's load_checkpoint) and trains on to ``train_iters``. Each run writes
``{iteration: lm loss}`` to its ``out``. The batches (one row per sample) come from ``batches``, the file the test
wrote from our mock dataset.
"""
import argparse
import ast
import json
import os
import random
import socket
import sys

import mcore_checkpoint_side as side  # noqa: F401  (applies the CPU patches before Megatron is imported)
import numpy as np
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402


def _gloo_tensor_collectives():
    """gloo lacks reduce_scatter_tensor and all_gather_into_tensor (Megatron's DDP, distributed optimizer and
    sequence parallelism use them): an all-reduce then this rank's dim-0 chunk, and an all-gather into a list."""

    def rs(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        n = dist.get_world_size(group)
        full = input.clone()
        if n > 1:
            dist.all_reduce(full, op=op, group=group)
        output.copy_(full.chunk(n)[dist.get_rank(group)])
        return _Done() if async_op else None

    def ag(output, input, group=None, async_op=False):
        n = dist.get_world_size(group)
        parts = [torch.empty_like(input) for _ in range(n)]
        if n > 1:
            dist.all_gather(parts, input.contiguous(), group=group)
        else:
            parts = [input]
        output.copy_(torch.cat(parts).view_as(output))
        return _Done() if async_op else None

    dist.reduce_scatter_tensor, dist.all_gather_into_tensor = rs, ag
    dist._reduce_scatter_base, dist._all_gather_base = rs, ag


def _cuda_factories_on_cpu():
    """Megatron's optimizers build a few tensors with ``device='cuda'`` (an overflow buffer, scalars): on CPU."""
    for name in ("tensor", "zeros", "empty", "ones", "full"):
        original = getattr(torch, name)

        def factory(*args, _original=original, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return _original(*args, **kwargs)

        setattr(torch, name, factory)
    # ... and accept only params whose type() names a CUDA tensor type (torch.cuda.FloatTensor).
    type_of = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):
        out = type_of(self, *args, **kwargs)
        if not args and not kwargs and out.startswith("torch.") and not out.startswith("torch.cuda."):
            return "torch.cuda." + out[len("torch."):]
        return out

    torch.Tensor.type = tensor_type
    # DDP's grad sync asks for the current CUDA stream (to wait on CUDA-graph events): a stream that never waits.
    torch.cuda.current_stream = lambda *a, **k: _Done()
    torch.Tensor.cuda = lambda self, *a, **k: self  # the optimizer state gathers move buffers to the GPU


class _Done:
    """A finished collective's handle, and a CUDA stream with nothing to wait for."""

    def wait(self, *args):
        return None

    wait_event = wait_stream = wait


def megatron_args(job, tp, iteration, consumed):
    """Megatron-LM's args namespace: every flag at its 0.19.2 default (from the flag table), then this run's."""
    ns = argparse.Namespace()
    with open(job["flags_tsv"]) as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            if line.startswith("#") or cols[0] == "options" or len(cols) < 5 or cols[1] == "help":
                continue
            try:
                value = ast.literal_eval(cols[4]) if cols[4] else None
            except (ValueError, SyntaxError):
                value = cols[4]
            setattr(ns, cols[1], value)
    for k, v in job["args"].items():
        setattr(ns, k, v)
    ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size = tp, 1
    ns.world_size = dist.get_world_size()
    ns.data_parallel_size = ns.world_size // tp
    ns.iteration, ns.consumed_train_samples, ns.consumed_valid_samples = iteration, consumed, 0
    ns.ckpt_format = "torch_dist"
    return ns


def build(job, tp):
    cfg = job["model"]
    model = side.build(cfg, tp)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=job["distributed_optimizer"])
    model = DistributedDataParallel(model.config, ddp_config, model)
    a = job["args"]
    opt_config = OptimizerConfig(optimizer="adam", lr=a["lr"], min_lr=a["min_lr"], weight_decay=a["weight_decay"],
                                 adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=a["clip_grad"],
                                 use_distributed_optimizer=job["distributed_optimizer"], params_dtype=torch.float32)
    optimizer = get_megatron_optimizer(opt_config, [model])
    gbs, iters = a["global_batch_size"], a["train_iters"]
    # megatron/training/training.py's get_optimizer_param_scheduler: steps are counted in samples.
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=a["lr"], min_lr=a["min_lr"], lr_warmup_steps=a["lr_warmup_iters"] * gbs,
        lr_decay_steps=iters * gbs, lr_decay_style=a["lr_decay_style"], start_wd=a["weight_decay"],
        end_wd=a["weight_decay"], wd_incr_steps=iters * gbs, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=False)
    return model, optimizer, scheduler


def train_step(job, model, optimizer, scheduler, batches, iteration):
    """One iteration of Megatron's no-pipelining schedule, by hand: each micro-batch's loss is its token mean
    divided by the number of micro-batches; the reported lm loss is token-weighted over the global batch."""
    a = job["args"]
    gbs, mbs = a["global_batch_size"], a["micro_batch_size"]
    num_micro = gbs // mbs
    seq = batches["tokens"].shape[1]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    total, tokens = 0.0, 0.0
    for m in range(num_micro):
        rows = slice(iteration * gbs + m * mbs, iteration * gbs + (m + 1) * mbs)
        out = model(batches["tokens"][rows], batches["position_ids"][rows], mask, labels=batches["labels"][rows])
        loss_mask = batches["loss_mask"][rows].float()
        loss_sum = (out.float() * loss_mask).sum()
        ntok = loss_mask.sum()
        (loss_sum / ntok / num_micro).backward()
        total, tokens = total + loss_sum.item(), tokens + ntok.item()
    model.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(increment=gbs)
    return total / tokens


def metadata(job):
    """megatron/training/checkpointing.py's _build_sharded_state_dict_metadata (no dp_cp_group: not saved)."""
    md = {}
    if job["distributed_optimizer"]:
        md["distrib_optim_sharding_type"] = job["sharding_type"]
        if job["sharding_type"] == "fully_reshardable":
            md["distrib_optim_fully_reshardable_mem_efficient"] = False
    md["singleton_local_shards"] = False
    md["chained_optim_avoid_prefix"] = True
    return md


def rng_state():
    tp = parallel_state.get_tensor_model_parallel_world_size()
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None, "rng_tracker_states": {}}
    return ShardedObject("rng_state", [state], (1, tp), (0, parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=parallel_state.get_data_parallel_rank())


def state_dict(job, model, optimizer, scheduler, iteration, loading=False):
    """megatron/training/checkpointing.py's generate_state_dict for torch_dist."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    gbs = job["args"]["global_batch_size"]
    md = metadata(job) if not loading else job["loaded_metadata"]
    sd = {"args": megatron_args(job, tp, iteration, iteration * gbs), "checkpoint_version": 3.0,
          "iteration": iteration, "model": model.module.sharded_state_dict(metadata=md)}  # save_checkpoint unwraps DDP
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=loading, metadata=md)
    sd["opt_param_scheduler"] = scheduler.state_dict()
    sd["rng_state"] = rng_state()
    sd["num_floating_point_operations_so_far"] = 0
    return sd


def save(job, model, optimizer, scheduler, iteration):
    ckpt = os.path.join(job["ckpt_dir"], f"iter_{iteration:07d}")
    sd = state_dict(job, model, optimizer, scheduler, iteration)
    if dist.get_rank() == 0:
        os.makedirs(ckpt)
    dist.barrier()
    dist_checkpointing.save(sd, ckpt, content_metadata=metadata(job))
    if dist.get_rank() == 0:
        with open(os.path.join(job["ckpt_dir"], "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def _init_optimizer_state(optimizer):
    """Zero Adam state for a fresh optimizer: Megatron's DistributedOptimizer.state_dict (called while building the
    load request) reads each param's ``step``, which torch's AdamW (its optimizer without TE / Apex, as on CPU)
    creates only at the first step; TE's FusedAdam keeps it in the param groups instead."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state = opt.optimizer.state[p]
                if not state:
                    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))


def _torch_adam_step_on_load():
    """Megatron's fully_reshardable load copies each saved state into the optimizer's per-param state tensors,
    which for torch's AdamW include ``step`` (TE's FusedAdam keeps it in the param groups) that the checkpoint has
    per group, not per param: that entry is skipped (the step itself is restored from the groups)."""
    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def patched(self, model_param, tensors):
        return set_states(self, model_param, {"step": None, **tensors})

    DistributedOptimizer._set_main_param_and_optimizer_states = patched


def _own_steps(optimizer):
    """Megatron's load (torch AdamW path) gives every param the same ``step`` tensor, which AdamW increments in
    place once per param: each param gets its own copy, as after a fresh start."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def load(job, model, optimizer, scheduler):
    with open(os.path.join(job["ckpt_dir"], "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read().strip())
    ckpt = os.path.join(job["ckpt_dir"], f"iter_{iteration:07d}")
    common = dist_checkpointing.load_common_state_dict(ckpt)
    job["loaded_metadata"] = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    saved_layout = (common["args"].tensor_model_parallel_size, common["args"].pipeline_model_parallel_size)
    _init_optimizer_state(optimizer)
    sd = state_dict(job, model, optimizer, scheduler, iteration, loading=True)
    if saved_layout != (job["tp"], 1):
        del sd["rng_state"]  # "(TP, PP) mismatch after resume ...: RNG state will be ignored"
    loaded = dist_checkpointing.load(sd, ckpt)
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    _own_steps(optimizer)
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    consumed = loaded["args"].consumed_train_samples
    assert consumed == iteration * job["args"]["global_batch_size"], (consumed, iteration)
    return loaded["iteration"]


def rank_main(rank, job, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=job["ranks"])
    _gloo_tensor_collectives()
    _cuda_factories_on_cpu()
    _torch_adam_step_on_load()
    batches = torch.load(job["batches"])
    for run in job["runs"]:
        run_one({**{k: v for k, v in job.items() if k != "runs"}, **run}, batches, rank)
    dist.barrier()
    dist.destroy_process_group()


def run_one(job, batches, rank):
    """One run at its own TP (the job's ``tp`` by default); the other ranks are data parallel, each computing the
    whole global batch (the average of equal gradients is exact), so the losses do not depend on the DP size."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=job["tp"])
    torch.manual_seed(job["model"].get("seed", 1234))
    model, optimizer, scheduler = build(job, job["tp"])
    losses = {}
    start = 0
    if job["mode"] == "resume":
        start = load(job, model, optimizer, scheduler)
    for it in range(start, job["args"]["train_iters"]):
        losses[it + 1] = train_step(job, model, optimizer, scheduler, batches, it)
        if job["mode"] == "train" and it + 1 == job["save_at"]:
            save(job, model, optimizer, scheduler, it + 1)
    if rank == 0:
        with open(job["out"], "w") as f:
            json.dump(losses, f)
    dist.barrier()


def main(argv):
    job = json.loads(argv[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for run in job["runs"]:
        os.makedirs(run["ckpt_dir"], exist_ok=True)
    # Forked, not spawned: the ranks inherit Megatron's imports (see mcore_checkpoint_side.main).
    torch.multiprocessing.start_processes(rank_main, args=(job, port), nprocs=job["ranks"], start_method="fork")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
