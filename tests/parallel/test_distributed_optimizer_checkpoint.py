"""Optimizer state saved through dist_checkpointing reshards between the distributed optimizer and
the plain one: resuming either way continues exactly like the uninterrupted run."""
import torch
import torch.distributed as dist

from tests.parallel.dist_utils import run_distributed
from tests.parallel.test_ddp_invariance import GBS, LR, TinyNet, _data


def _build(distopt, dtype=torch.float32):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = DistributedDataParallel(None, DistributedDataParallelConfig(use_distributed_optimizer=distopt,
                                                                        bucket_size=100,
                                                                        overlap_grad_reduce=True), TinyNet(dtype))
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=0.1, clip_grad=1.0,
                                                 bf16=dtype == torch.bfloat16,
                                                 use_distributed_optimizer=distopt), [model])
    return model, opt


def _model_sharded_state_dict(model):
    from megatron.core.dist_checkpointing import ShardedTensor

    dp_rank = dist.get_rank()
    return {name: ShardedTensor.from_rank_offsets(name, p, replica_id=dp_rank)
            for name, p in model.module.state_dict(keep_vars=True).items()}


def _step(model, opt, it):
    from megatron.core.distributed import finalize_model_grads

    xs, ys = _data()
    local = GBS // dist.get_world_size()
    sl = slice(dist.get_rank() * local, (dist.get_rank() + 1) * local)
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(xs[it, sl].to(next(model.parameters()).dtype)).float(), ys[it, sl])
    loss.backward()
    finalize_model_grads([model])
    opt.step()
    return loss.item()


def _sharded(model, opt, is_loading=False):
    model_sd = _model_sharded_state_dict(model)
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading)}


def save_then_resume(ckpt_dir, dtype):
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    model, opt = _build(distopt=True, dtype=dtype)
    for it in range(2):
        _step(model, opt, it)
    dist_checkpointing.save(_sharded(model, opt), ckpt_dir)
    expected_loss = _step(model, opt, 2)
    expected_params = [p.detach().clone() for p in model.module.parameters()]

    out = {}
    for distopt in (False, True):
        model2, opt2 = _build(distopt=distopt, dtype=dtype)
        loaded = dist_checkpointing.load(_sharded(model2, opt2, is_loading=True), ckpt_dir)
        model2.module.load_state_dict(loaded["model"])
        opt2.reload_model_params()
        opt2.load_state_dict(loaded["optimizer"])
        loss = _step(model2, opt2, 2)
        diff = max((a.float() - b.float()).abs().max().item()
                   for a, b in zip(expected_params, model2.module.parameters()))
        out[distopt] = (loss == expected_loss, diff)
    return out


def test_distopt_state_reshards_to_plain_and_back(tmp_path):
    for dtype in (torch.float32, torch.bfloat16):
        ckpt = tmp_path / str(dtype).split(".")[-1]
        ckpt.mkdir()
        results = run_distributed(save_then_resume, 2, str(ckpt), dtype)
        for rank_result in results:
            # Same layout resumes bit for bit. Switching the distributed optimizer off changes the
            # order of the grad-norm sum (shards vs whole params): the clip factor moves by ~1 ulp.
            assert rank_result[True] == (True, 0.0), (dtype, rank_result)
            tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one ulp at |w| ~ 1 is 2^-8
            assert rank_result[False][0] and rank_result[False][1] <= tol, (dtype, rank_result)
