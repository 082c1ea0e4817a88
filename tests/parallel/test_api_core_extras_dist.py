"""Megatron Core names that need ranks, one 4-rank gloo world: the last-dim and sp<->hp mappings against
the unsharded tensors, the extra CP / all-gather groups, set_data_parallel_rank, the TP batch broadcast,
the frozen-weight linear under sequence parallelism, zero counting over TP, DistributedOptimizer built
with Megatron's constructor, and the DTensor parameter norm. Values are exact (copies and fp32 sums of a few
terms: 1e-6)."""
import torch
import torch.distributed as dist

from tests.fixtures.tiny_gpt import tiny_config
from tests.parallel.dist_utils import run_distributed


def _full(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mappings(rank, n):
    from megatron.core.tensor_parallel import mappings as M
    world = dist.group.WORLD
    full = _full(3, 2, 8)
    c = [_full(3, 2, 8, seed=10 + r) for r in range(n)]  # rank r's output weights
    x = full.chunk(n, dim=-1)[rank].clone().requires_grad_()
    y = M.all_gather_last_dim_from_tensor_parallel_region(x, group=world)
    assert torch.equal(y, full)
    (y * c[rank]).sum().backward()
    torch.testing.assert_close(x.grad, sum(c).chunk(n, dim=-1)[rank], rtol=1e-6, atol=1e-6)
    part = (full * (rank + 1)).requires_grad_()
    z = M.reduce_scatter_last_dim_to_tensor_parallel_region(part, group=world)
    torch.testing.assert_close(z, (full * sum(range(1, n + 1))).chunk(n, dim=-1)[rank], rtol=1e-6, atol=1e-6)
    (z * c[rank].chunk(n, dim=-1)[rank]).sum().backward()
    torch.testing.assert_close(part.grad, torch.cat([c[r].chunk(n, dim=-1)[r] for r in range(n)], dim=-1))
    tokens = _full(8, 12, seed=3)  # [T, H]
    sp = tokens.chunk(n, dim=0)[rank]
    hp = M.all_to_all_sp2hp(sp, group=world)
    assert torch.equal(hp, tokens.chunk(n, dim=1)[rank])
    assert torch.equal(M.all_to_all_hp2sp(hp, group=world), sp)
    rows = _full(n * 2, 3, seed=20 + rank).requires_grad_()
    out = M.all_to_all(world, rows)
    expect = torch.cat([_full(n * 2, 3, seed=20 + r)[2 * rank:2 * rank + 2] for r in range(n)])
    assert torch.equal(out, expect)
    out.sum().backward()
    assert torch.equal(rows.grad, torch.ones_like(rows))


def _groups(rank):
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    ranks = dist.get_process_group_ranks
    ps.initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2],
                                 hybrid_context_parallel=True)
    level0, level1 = ps.get_hierarchical_context_parallel_groups()
    assert ranks(level0) == [rank - rank % 2, rank - rank % 2 + 1] and ranks(level1) == [rank % 2, rank % 2 + 2]
    assert ProcessGroupCollection.use_mpu_process_groups(["hcp"]).hcp == [level0, level1]  # what a2a+p2p reads
    assert ranks(ps.get_hybrid_data_context_parallel_groups(group_size=2)) == ranks(level0)
    assert ps.get_hybrid_data_context_parallel_groups(group_size=4) is ps.get_data_parallel_group(True)
    ag, expert_ag = ps.create_all_gather_groups(for_expert_parallelism=True)
    assert ranks(ag) == [0, 1, 2, 3] and expert_ag is None  # EP = 1: no expert all-gather group
    ps.set_data_parallel_rank(3)
    assert ps.get_data_parallel_rank() == 3
    ps.set_data_parallel_rank(None)
    assert ps.get_data_parallel_rank() == 0
    ps.destroy_model_parallel()


def _tp_pieces(rank):
    """TP=2 x DP=2."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import count_zeros_fp32
    from megatron.core.tensor_parallel.layers import linear_with_frozen_weight
    from megatron.core.utils import get_batch_on_this_tp_rank
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    src = ps.get_tensor_model_parallel_src_rank()
    seed = 100 + src  # each TP group has its own batch
    mine = {"tokens": torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(seed)),
            "labels": torch.arange(12).view(2, 6) + seed, "loss_mask": torch.ones(2, 6),
            "position_ids": torch.arange(6).repeat(2, 1),
            "cu_seqlens": torch.tensor([[0, 2, 6], [0, 6, 6]], dtype=torch.int32),
            "max_seqlen": torch.tensor([4, 6], dtype=torch.int32)}
    got = get_batch_on_this_tp_rank(mine if tp_rank == 0 else {}, True, False, False, src, tp, 1, tp_rank, 2, 6,
                                    False)
    for k in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen"):
        assert torch.equal(got[k], mine[k]), k
    # Frozen-weight linear under SP: all-gather the sequence, no weight grad, dL/dx reduce-scattered.
    w, x_full = _full(5, 4, seed=1), _full(6, 1, 4, seed=2)
    c = [_full(6, 1, 5, seed=30 + r) for r in range(2)]
    x = x_full.chunk(2)[tp_rank].clone().requires_grad_()
    y = linear_with_frozen_weight(x, w, None, False, False, True, tp)
    torch.testing.assert_close(y, x_full @ w.t(), rtol=1e-6, atol=1e-6)
    (y * c[tp_rank]).sum().backward()
    torch.testing.assert_close(x.grad, ((c[0] + c[1]) @ w).chunk(2)[tp_rank], rtol=1e-5, atol=1e-6)
    # Zeros: a TP-split param counts on both TP ranks, a replicated one only on TP rank 0.
    split, replicated = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))
    split.tensor_model_parallel = True
    split.grad, replicated.grad = torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.zeros(3)
    zeros = count_zeros_fp32([split, replicated], ps.get_model_parallel_group(), tp_group=tp)
    assert zeros == 2 * 2 + 3  # per TP group (model-parallel group = TP here)
    ps.destroy_model_parallel()


def _distributed_optimizer(rank):
    """Megatron's constructor (explicit buffers and DP group) takes the same step as our factory."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
    ps.initialize_model_parallel()
    config = OptimizerConfig(lr=1e-2, use_distributed_optimizer=True)
    results = []
    for explicit in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        model = DistributedDataParallel(None, DistributedDataParallelConfig(use_distributed_optimizer=True), net)
        if explicit:
            inner = torch.optim.AdamW([p for p in model.module.parameters()], lr=1e-2, foreach=False)
            opt = DistributedOptimizer(inner, config, None, None, [model], {0: model.buffers},
                                       ps.get_data_parallel_group(), ps.get_data_parallel_group_gloo(), 0, 0)
        else:
            opt = get_megatron_optimizer(config, [model], config_overrides={})
        model.zero_grad_buffer()
        model(_full(3, 4, seed=rank)).pow(2).sum().backward()
        model.finish_grad_sync()
        ok, _, _ = opt.step()
        model.finish_param_sync()
        results.append(torch.cat([p.detach().reshape(-1) for p in model.module.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    # Megatron-FSDP's constructor: every sharding strategy takes the step plain DDP takes (fp32 sums in
    # another order: 1e-6).
    from megatron.core.distributed import FullyShardedDataParallel, TorchFullyShardedDataParallel
    cfg = tiny_config(num_layers=1, hidden_size=8, num_attention_heads=2)
    steps = {}
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        ddp_config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
        model = FullyShardedDataParallel(cfg, ddp_config, net)
        assert isinstance(model, TorchFullyShardedDataParallel) == strategy.startswith("optim_grads")
        opt = get_megatron_optimizer(config, [model])  # use_distributed_optimizer=True, as Megatron-FSDP scripts
        model.zero_grad_buffer()
        model(_full(3, 4, seed=rank)).pow(2).sum().backward()
        model.finish_grad_sync()
        assert opt.step()[0]
        model.finish_param_sync() if hasattr(model, "finish_param_sync") else None
        steps[strategy] = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                                     for p in model.module.parameters()])
    for strategy, params in steps.items():
        torch.testing.assert_close(params, steps["no_shard"], rtol=1e-6, atol=1e-6, msg=strategy)
    ps.destroy_model_parallel()


def _dtensor_norm(rank, n):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from megatron.training.utils import calc_dtensor_params_l2_norm
    mesh = init_device_mesh("cpu", (n,))
    a, b = _full(8, 3, seed=5), _full(5, seed=6)
    params = [distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Replicate()])]
    expect = (a.pow(2).sum() + b.pow(2).sum()).sqrt().item()
    assert abs(calc_dtensor_params_l2_norm(params) - expect) < 1e-5 * expect


def _world():
    rank, n = dist.get_rank(), dist.get_world_size()
    _dtensor_norm(rank, n)
    _mappings(rank, n)
    _groups(rank)
    _tp_pieces(rank)
    _distributed_optimizer(rank)
    return True


def test_core_extras_on_four_ranks():
    assert run_distributed(_world, 4) == [True] * 4
