"""The Megatron Core quick-start loop: a tiny GPT trained with the library alone (no training harness).

Shows: parallel_state, TransformerConfig, GPTModel built from get_gpt_layer_with_transformer_engine_spec
(Megatron's name; here it returns our fastest spec, no Transformer Engine needed), MockGPTDataset
through BlendedMegatronDatasetBuilder, DistributedDataParallel with finalize_model_grads and
get_megatron_optimizer, get_forward_backward_func, and dist_checkpointing save/load of the model's
sharded_state_dict. Takes ~10 s on 2 CPU cores.

    torchrun --nproc-per-node 2 examples/run_simple_mcore_train_loop.py            # TP=2 (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 4 examples/run_simple_mcore_train_loop.py --tp 2 --pp 2

Options (all optional): --tp, --pp, --iters, --ckpt-dir (default ./ckpt).
"""
import argparse
import os
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import compile_helpers
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.tokenizer.tokenizer import _NullTokenizer

_SEQUENCE_LENGTH = 64
_MICRO_BATCH_SIZE = 8
_NUM_MICROBATCHES = 2


def initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
    """torch.distributed from the torchrun environment, then Megatron's model-parallel groups."""
    parallel_state.destroy_model_parallel()
    rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)


def model_provider():
    """A 2-layer GPT; each pipeline stage builds only its own layers."""
    transformer_config = TransformerConfig(
        num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size())
    return GPTModel(
        config=transformer_config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(), vocab_size=100,
        max_sequence_length=_SEQUENCE_LENGTH, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage())


def get_train_data_iterator():
    """Mock GPT samples; every rank draws the same order (seeded shuffle), so TP ranks see equal batches."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_rank() == 0:
            compile_helpers()
        torch.distributed.barrier()
    else:
        compile_helpers()
    config = GPTDatasetConfig(
        random_seed=0, sequence_length=_SEQUENCE_LENGTH, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, tokenizer=_NullTokenizer(vocab_size=_SEQUENCE_LENGTH))
    datasets = BlendedMegatronDatasetBuilder(MockGPTDataset, [1000, None, None], lambda: True, config).build()
    generator = torch.Generator().manual_seed(1234)
    train_dataloader = DataLoader(datasets[0], batch_size=_MICRO_BATCH_SIZE, shuffle=True, generator=generator)
    return iter(train_dataloader)


def forward_step_func(data_iterator, model, device):
    """One micro-batch: (per-token loss, the function that averages it over unmasked tokens)."""

    def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
        losses = output_tensor.float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
        # With data parallelism, reduce the loss across the data-parallel group for reporting.
        return loss, {"lm loss": loss}

    data = next(data_iterator)
    tokens = data["tokens"].to(device)
    attention_mask = data["attention_mask"].to(device)
    position_ids = data["position_ids"].to(device)
    labels = data["labels"].to(device)
    loss_mask = data["loss_mask"].to(device)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def save_distributed_checkpoint(checkpoint_path, gpt_model):
    model = gpt_model.module if hasattr(gpt_model, "module") else gpt_model  # unwrap DDP
    sharded_state_dict = model.sharded_state_dict(prefix="")
    dist_checkpointing.save(sharded_state_dict=sharded_state_dict, checkpoint_dir=checkpoint_path)


def load_distributed_checkpoint(checkpoint_path, gpt_model):
    model = gpt_model.module if hasattr(gpt_model, "module") else gpt_model  # unwrap DDP
    sharded_state_dict = model.sharded_state_dict(prefix="")
    checkpoint = dist_checkpointing.load(sharded_state_dict=sharded_state_dict, checkpoint_dir=checkpoint_path)
    model.load_state_dict(checkpoint)
    return gpt_model


def main(tp=2, pp=1, iters=5, ckpt_dir=None):
    """Train ``iters`` steps, save, reload; returns (last-stage losses per step, max param diff after reload)."""
    initialize_distributed(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(123)

    gpt_model = model_provider()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    gpt_model.to(device)
    # DDP keeps gradients in a contiguous `main_grad` buffer (synchronised by finalize_model_grads), so
    # the optimizer must be Megatron's, which reads main_grad; a bare torch optimizer would see no .grad.
    config = gpt_model.config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    gpt_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt_model)
    optim = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [gpt_model])
    train_iterator = get_train_data_iterator()
    forward_backward_func = get_forward_backward_func()

    history = []
    for _ in range(iters):
        optim.zero_grad()
        gpt_model.zero_grad_buffer()
        losses_reduced = forward_backward_func(
            forward_step_func=partial(forward_step_func, device=device), data_iterator=train_iterator,
            model=gpt_model, num_microbatches=_NUM_MICROBATCHES, seq_length=_SEQUENCE_LENGTH,
            micro_batch_size=_MICRO_BATCH_SIZE, decoder_seq_length=_SEQUENCE_LENGTH, forward_only=False)
        # All-reduce grads over DP, and over TP for the replicated (layernorm) params.
        finalize_model_grads([gpt_model])
        optim.step()
        if losses_reduced:  # only the last pipeline stage has losses
            step_loss = sum(d["lm loss"].detach().item() for d in losses_reduced) / len(losses_reduced)
            history.append(step_loss)
            print(f"Losses reduced :  {losses_reduced}", flush=True)

    ckpt_path = ckpt_dir or os.path.join(os.getcwd(), "ckpt")
    Path(ckpt_path).mkdir(parents=True, exist_ok=True)
    save_distributed_checkpoint(gpt_model=gpt_model, checkpoint_path=ckpt_path)
    # Tensors with values (the Transformer Engine spec's names include empty _extra_state entries).
    before = {k: v.detach().clone() for k, v in gpt_model.state_dict().items()
              if isinstance(v, torch.Tensor) and v.numel()}
    for p in gpt_model.parameters():  # make the reload observable
        p.data.zero_()
    gpt_model = load_distributed_checkpoint(gpt_model=gpt_model, checkpoint_path=ckpt_path)
    gpt_model.to(device)
    after = gpt_model.state_dict()
    max_diff = max((before[k].float() - after[k].float()).abs().max().item() for k in before if k in after)
    print(f"Successfully loaded the model (max parameter difference {max_diff:.1e})", flush=True)
    return history, max_diff


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-model-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-model-parallel size")
    parser.add_argument("--iters", type=int, default=5, help="training iterations")
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default ./ckpt)")
    return parser.parse_args()


if __name__ == "__main__":
    opts = _parse()
    main(opts.tp, opts.pp, opts.iters, opts.ckpt_dir)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
