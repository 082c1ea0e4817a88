"""Rewrite a GPT checkpoint under another format (torch <-> torch_dist) and TP/PP layout, on spawned gloo ranks.

One process per target model-parallel rank builds the model under the target layout, loads and saves.
A torch_dist source is read directly under the target layout (every tensor is stored under its global
key); a legacy torch source is first loaded under its own layout and rewritten as torch_dist in a
temporary directory. Optimizer and RNG state are not converted.
"""
import copy
import os
import shutil
import sys
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.training.global_vars import set_args
from megatron.training.model_setup import get_model

from . import paths
from .args import read_checkpoint_args
from .load import load_checkpoint
from .save import save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _rank_args(ckpt_args, load_dir, save_dir, fmt, tp, pp, iteration, megatron_layout=False):
    """The checkpoint's args re-targeted: new layout, model weights only (in Megatron-LM's layout with
    ``megatron_layout``)."""
    args = copy.deepcopy(ckpt_args)
    world = tp * pp
    overrides = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=world,
                     data_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                     load=load_dir, save=save_dir, ckpt_format=fmt, auto_detect_ckpt_format=True,
                     ckpt_step=iteration, no_load_optim=True, no_save_optim=True, no_load_rng=True,
                     no_save_rng=True, finetune=False, pretrained_checkpoint=None, async_save=False,
                     exit_on_missing_checkpoint=True, save_retain_interval=None, use_distributed_optimizer=False,
                     sequence_parallel=False, use_checkpoint_args=False, ckpt_save_megatron_layout=megatron_layout)
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def _worker(rank, world, rendezvous, args, queue):
    """One target rank: build the model under the target layout, load, save."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        # A file rendezvous: the ranks share this host, and no TCP port can be taken by another process
        # between choosing it and binding it.
        torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                                             world_size=world)
        args.rank = rank
        _convert_on_rank(args)
        queue.put((rank, None))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _convert_on_rank(args):
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from pretrain_gpt import model_provider  # lazy: an entry script at the checkout root, on sys.path from above

    set_args(args)
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=args.pipeline_model_parallel_size)
    model_parallel_cuda_manual_seed(getattr(args, "seed", 1234))  # a checkpoint's args: may predate --seed
    model = get_model(model_provider, wrap_with_ddp=False)
    iteration, flops = load_checkpoint(model, None, None)
    save_checkpoint(iteration, model, None, None, flops)
    ps.destroy_model_parallel()


def run_ranks(args, world):
    """Run the conversion on ``world`` spawned gloo ranks; raise with the first failing rank's traceback."""
    ctx = mp.get_context("spawn")
    rendezvous_dir = tempfile.mkdtemp(prefix="ckpt_convert_rdzv_")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(rendezvous_dir, "store"), args, queue))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        errors = []
        for _ in range(world):
            rank, err = queue.get(timeout=1800)
            if err:
                errors.append((rank, err))
                break
        for p in procs:
            p.join(timeout=10 if errors else None)
            if p.is_alive():
                p.kill()
    finally:
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
    if errors:
        raise SystemExit(f"error: conversion failed on rank {errors[0][0]}:\n{errors[0][1]}")


def convert(load_dir, save_dir, target_format, tp=None, pp=None, iteration=None, megatron_layout=False):
    ckpt_args, iteration = read_checkpoint_args(load_dir, iteration)
    src_dir = paths.get_checkpoint_name(load_dir, iteration, return_base_dir=True)
    tp = tp or ckpt_args.tensor_model_parallel_size
    pp = pp or ckpt_args.pipeline_model_parallel_size
    if os.path.abspath(load_dir) == os.path.abspath(save_dir):
        raise SystemExit("error: --save-dir must differ from --load-dir")
    tmp = None
    try:
        if paths.detect_format(src_dir) == "torch":
            # Legacy files are per (TP, PP) rank: read them under their own layout first.
            tmp = tempfile.mkdtemp(prefix="ckpt_convert_", dir=os.path.dirname(os.path.abspath(save_dir)))
            stp, spp = ckpt_args.tensor_model_parallel_size, ckpt_args.pipeline_model_parallel_size
            run_ranks(_rank_args(ckpt_args, load_dir, tmp, "torch_dist", stp, spp, iteration), stp * spp)
            load_dir = tmp
        run_ranks(_rank_args(ckpt_args, load_dir, save_dir, target_format, tp, pp, iteration, megatron_layout),
                  tp * pp)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    layout = " in Megatron-LM's layout" if megatron_layout else ""
    print(f"converted {src_dir} to {target_format}{layout} (TP={tp}, PP={pp}) under {save_dir}")
