"""DDP and the distributed optimizer reproduce a single-process run at the same global batch.

A tiny fp32 MLP (Linear, LayerNorm, Linear) is trained for a few iterations with AdamW + clipping.
The reference is plain torch in this process on the whole global batch. fp32 sums over a different
reduction order differ by ~1e-7 relative, so 1e-5 relative is a tight but safe bound.
"""
import pytest
import torch
import torch.distributed as dist

from tests.parallel.dist_utils import run_distributed

ITERS, GBS, IN, HID, OUT, LR, CLIP = 3, 8, 8, 16, 4, 1e-2, 0.5


class TinyNet(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(1234)
        self.fc1 = torch.nn.Linear(IN, HID)
        self.norm = torch.nn.LayerNorm(HID)
        self.fc2 = torch.nn.Linear(HID, OUT)
        for p in self.parameters():
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = False, -1, 1
        self.to(dtype)

    def forward(self, x):
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


def _data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(ITERS, GBS, IN, generator=g), torch.randn(ITERS, GBS, OUT, generator=g)


def reference_run():
    """Single process, whole global batch, torch AdamW and clip (same param groups as Megatron)."""
    model = TinyNet()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, foreach=False)
    xs, ys = _data()
    losses, norms = [], []
    for it in range(ITERS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs[it]), ys[it])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms


def _train(ddp_kwargs, num_microbatches=2, inject_inf_rank=None, fp16=False):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        TorchFullyShardedDataParallel,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    ddp_kwargs = dict(ddp_kwargs)
    wrapper = TorchFullyShardedDataParallel if ddp_kwargs.pop("fsdp2", False) else DistributedDataParallel
    ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
    model = wrapper(None, ddp_config, TinyNet())
    model.broadcast_params()
    opt_config = OptimizerConfig(lr=LR, weight_decay=0.1, clip_grad=CLIP, fp16=fp16, hysteresis=1,
                                 initial_loss_scale=2.0 ** 8 if fp16 else 2.0 ** 32,
                                 use_distributed_optimizer=ddp_config.use_distributed_optimizer,
                                 overlap_param_gather=ddp_config.overlap_param_gather, log_num_zeros_in_grad=True)
    opt = get_megatron_optimizer(opt_config, [model])
    xs, ys = _data()
    local = GBS // world
    mbs = local // num_microbatches
    losses, norms, skipped = [], [], []
    for it in range(ITERS):
        model.zero_grad_buffer()
        opt.zero_grad()
        x = xs[it, rank * local:(rank + 1) * local]
        y = ys[it, rank * local:(rank + 1) * local]
        total = torch.zeros(())
        for mb in range(num_microbatches):
            sl = slice(mb * mbs, (mb + 1) * mbs)
            loss = torch.nn.functional.mse_loss(model(x[sl]), y[sl]) / num_microbatches
            if mb < num_microbatches - 1:
                with model.no_sync():
                    opt.scale_loss(loss).backward()
            else:
                opt.scale_loss(loss).backward()
            total += loss.detach()
        if inject_inf_rank == rank and it == 1:  # a local overflow, before the DP reduction
            next(iter(model.module.parameters())).main_grad.view(-1)[0] = float("inf")
        finalize_model_grads([model])
        ok, norm, zeros = opt.step()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        norms.append(norm)
        skipped.append(not ok)
    state_numel = sum(t.numel() for s in opt.optimizer.state.values() for t in s.values() if t.dim() > 0)
    model.finish_param_sync()
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.module.parameters()]
    num_buckets = len(list(model._all_buckets())) if hasattr(model, "_all_buckets") else 0
    return {"losses": losses, "norms": norms, "skipped": skipped, "state_numel": state_numel,
            "params": params, "loss_scale": opt.get_loss_scale().item(), "num_buckets": num_buckets}


CONFIGS = {
    "plain": {},
    "overlap": {"overlap_grad_reduce": True, "bucket_size": 100},
    "fp32_reduce_avg": {"grad_reduce_in_fp32": True, "average_in_collective": True},
    "distopt": {"use_distributed_optimizer": True},
    "distopt_overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                        "overlap_param_gather": True, "bucket_size": 100},
    "fsdp2": {"fsdp2": True},
}


def run_configs(names):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    return {name: _train(CONFIGS[name]) for name in names}


@pytest.fixture(scope="module")
def reference():
    return reference_run()


def _check_matches(result, reference):
    ref_losses, ref_norms = reference
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert result["norms"] == pytest.approx(ref_norms, rel=1e-5)


def test_dp2_all_configs_match_single_process(reference):
    results = run_distributed(run_configs, 2, list(CONFIGS))
    for name in CONFIGS:
        for rank_result in results:
            _check_matches(rank_result[name], reference)
        for a, b in zip(results[0][name]["params"], results[1][name]["params"]):
            assert torch.equal(a, b), f"{name}: params differ across DP ranks"
    assert results[0]["overlap"]["num_buckets"] > 1
    # Optimizer state per rank drops to ~1/DP with the distributed optimizer.
    full = results[0]["plain"]["state_numel"]
    sharded = [r["distopt"]["state_numel"] for r in results]
    assert sum(sharded) >= full and max(sharded) <= full / 2 + 2 * 64


def test_dp4_overlap_and_distopt_match_single_process(reference):
    results = run_distributed(run_configs, 4, ["overlap", "distopt_overlap"])
    for rank_result in results:
        for name in ("overlap", "distopt_overlap"):
            _check_matches(rank_result[name], reference)


def fp16_overflow():
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    return [_train({"use_distributed_optimizer": distopt}, inject_inf_rank=1, fp16=True)
            for distopt in (False, True)]


def test_fp16_overflow_on_one_rank_skips_everywhere():
    results = run_distributed(fp16_overflow, 2)
    for variant in range(2):  # plain DDP, distributed optimizer
        for r in (results[0][variant], results[1][variant]):
            assert r["skipped"] == [False, True, False]
            assert r["norms"][1] is None
            assert r["loss_scale"] == 2.0 ** 7  # hysteresis 1: one overflow halves the scale
        for a, b in zip(results[0][variant]["params"], results[1][variant]["params"]):
            assert torch.equal(a, b)
