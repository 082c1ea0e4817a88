"""One rank of test_parallel_save_gpu.py (run under torchrun, 2 GPUs): a bf16 GPT with the distributed optimizer
trains a step, then a torch_dist save runs; prints this rank's peak extra GPU memory during the save and during a
whole load, the losses of the two steps after the save and after the load, the full optimizer state's bytes and the
bytes of the file this rank wrote, as one JSON line."""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from tests.fixtures.tiny_gpt import global_batch, tiny_config, tiny_gpt, train_step  # noqa: E402


def main(save_dir):
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    cfg = tiny_config(num_layers=4, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096, bf16=True,
                      params_dtype=torch.bfloat16)
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                    tiny_gpt(cfg).cuda())
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, bf16=True, use_distributed_optimizer=True), [model])
    train_step(model, opt, global_batch(0))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model_sd = model.module.sharded_state_dict()
    sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}
    group = ps.get_data_parallel_group(with_context_parallel=True)
    dist_checkpointing.save(sd, save_dir, sharded_strategy=FullyParallelSaveStrategyWrapper(None, group))
    torch.cuda.synchronize()
    save_peak_extra = torch.cuda.max_memory_allocated() - before
    # Fully parallel load over NCCL: each weight read by one rank and broadcast; equal to the saved weights.
    loaded = dist_checkpointing.load({"model": model.module.sharded_state_dict()}, save_dir,
                                     sharded_strategy=FullyParallelLoadStrategyWrapper(None, group))["model"]
    current = model.module.state_dict()
    load_equal = all(torch.equal(loaded[k].reshape(-1), current[k].reshape(-1))
                     for k in loaded if k in current and torch.is_tensor(loaded[k]))
    # Resume: the steps after the save, then a whole load (weights and optimizer state, into the live tensors, the
    # fp32 main params through the gradient buffer) and the same steps again give the same losses, and the load
    # allocates far less than the optimizer state.
    ref = [train_step(model, opt, global_batch(it))[0] for it in (1, 2)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model_sd = model.module.sharded_state_dict()
    request = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)}
    loaded = dist_checkpointing.load(request, save_dir)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    del loaded
    torch.cuda.synchronize()
    load_peak_extra = torch.cuda.max_memory_allocated() - before
    again = [train_step(model, opt, global_batch(it))[0] for it in (1, 2)]
    params = sum(p.numel() for p in model.module.parameters())
    out = {"rank": dist.get_rank(), "save_peak_extra_bytes": save_peak_extra,
           "load_peak_extra_bytes": load_peak_extra, "resumed_losses": [float(x) for x in again],
           "losses": [float(x) for x in ref],
           "full_optimizer_bytes": 12 * params,  # fp32 main weight + two Adam moments per parameter
           "load_equal": load_equal,
           "file_bytes": os.path.getsize(os.path.join(save_dir, f"__{dist.get_rank()}_0.distcp"))}
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
