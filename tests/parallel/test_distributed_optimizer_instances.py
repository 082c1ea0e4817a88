"""--num-distributed-optimizer-instances: the distributed optimizer's state replicated over N parts of the DP group,
each sharded within its part (gradients reduce-scattered within the part, the shard all-reduced across parts).
At 4 gloo ranks with 2 instances, training equals the single-process run (fp32, the same bound as the other DP
layouts), expert parameters included; each rank holds half of the state instead of a quarter; and a checkpoint
saved with 2 instances resumes with 1 (and back) exactly as the run continued."""
import pytest
import torch
import torch.distributed as dist

from tests.parallel.dist_utils import run_distributed
from tests.parallel.test_ddp_invariance import TinyNet, _train, reference_run

WORLD = 4


class _ExpertTinyNet(TinyNet):
    """TinyNet whose output layer is an expert parameter (reduced over the expert-DP group's buffers)."""

    def __init__(self, dtype=torch.float32):
        super().__init__(dtype)
        for p in self.fc2.parameters():
            p.allreduce = False


def _groups_and_train(instances, ddp_kwargs, expert=False):
    from megatron.core import parallel_state
    from tests.parallel import test_ddp_invariance

    parallel_state.initialize_model_parallel(1, 1, num_distributed_optimizer_instances=instances)
    intra = dist.get_process_group_ranks(parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                                                partial_data_parallel=True))
    inter = parallel_state.get_inter_distributed_optimizer_instance_group()
    inter = None if inter is None else dist.get_process_group_ranks(inter)
    if expert:
        test_ddp_invariance.TinyNet = _ExpertTinyNet  # this rank's process only
    try:
        result = _train({**ddp_kwargs, "num_distributed_optimizer_instances": instances})
    finally:
        test_ddp_invariance.TinyNet = TinyNet
    return {**result, "intra": intra, "inter": inter}


CONFIGS = {
    "distopt": {"use_distributed_optimizer": True},
    "distopt_overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True,
                        "bucket_size": 100},
    "distopt_avg": {"use_distributed_optimizer": True, "average_in_collective": True, "grad_reduce_in_fp32": True},
}


def _run_all():
    return {(name, expert, n): _groups_and_train(n, kw, expert)
            for name, kw in CONFIGS.items() for expert in (False, True) for n in (1, 2)}


def test_two_instances_train_like_one_process():
    ref_losses, ref_norms = reference_run()
    results = run_distributed(_run_all, WORLD)
    numel = sum(p.numel() for p in TinyNet().parameters())
    for rank, per_rank in enumerate(results):
        two = per_rank[("distopt", False, 2)]
        assert two["intra"] == [rank // 2 * 2, rank // 2 * 2 + 1] and two["inter"] == [rank % 2, rank % 2 + 2]
        for (name, expert, n), r in per_rank.items():
            assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), (name, expert, n)
            assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), (name, expert, n)
            for a, b in zip(per_rank[(name, expert, 1)]["params"], r["params"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name in CONFIGS:
        for n in (1, 2):
            # Each instance holds the whole state once (AdamW: 2 moments per element; the expert variant's
            # optimizer is a chain, whose first part `state_numel` counts, so it is left out here).
            assert sum(r[(name, False, n)]["state_numel"] for r in results) == n * 2 * numel, (name, n)


def _save_then_resume(ckpt_dir, save_instances, load_instances):
    from megatron.core import dist_checkpointing, parallel_state
    from tests.parallel.test_distributed_optimizer_checkpoint import _sharded, _step

    def build(instances):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        parallel_state.initialize_model_parallel(1, 1, num_distributed_optimizer_instances=instances)
        model = DistributedDataParallel(None, DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=100,
            num_distributed_optimizer_instances=instances), _ExpertTinyNet())
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0,
                                                     use_distributed_optimizer=True), [model])
        return model, opt

    model, opt = build(save_instances)
    for it in range(2):
        _step(model, opt, it)
    dist_checkpointing.save(_sharded(model, opt), ckpt_dir)
    expected_loss = _step(model, opt, 2)
    expected = [p.detach().clone() for p in model.module.parameters()]

    model2, opt2 = build(load_instances)
    loaded = dist_checkpointing.load(_sharded(model2, opt2, is_loading=True), ckpt_dir)
    model2.module.load_state_dict(loaded["model"])
    opt2.reload_model_params()
    opt2.load_state_dict(loaded["optimizer"])
    loss = _step(model2, opt2, 2)
    return loss, max((a - b).abs().max().item() for a, b in zip(expected, model2.module.parameters())), expected_loss


@pytest.mark.parametrize("save_instances,load_instances", [(2, 1), (1, 2), (2, 2)])
def test_checkpoint_with_instances_resumes_in_any_layout(tmp_path, save_instances, load_instances):
    for loss, diff, expected_loss in run_distributed(_save_then_resume, WORLD, str(tmp_path), save_instances,
                                                     load_instances):
        # Resharding between instance counts changes only the grad norm's summation order (~1 ulp of the clip).
        assert loss == pytest.approx(expected_loss, rel=1e-6) and diff <= 1e-6, (loss, expected_loss, diff)
