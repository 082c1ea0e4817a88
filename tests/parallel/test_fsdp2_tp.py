"""torch FSDP2 (`--use-torch-fsdp2`) composed with tensor parallelism.

A tiny GPT under TP=2 x DP=2 with FSDP2 (sequence parallel, 2 microbatches so `no_sync` is used)
must reproduce the TP=DP=1 loss and grad norm for 10 iterations: the norm checks that DP shards and
TP-replicated params are each counted once and that SP partial grads (DTensor shards) are summed over
TP. Checkpoints saved under FSDP2 load under FSDP2, under plain DDP with the same TP, under TP=1 x
DP=4 and on one rank (and a DDP checkpoint loads into FSDP2): the next two losses must equal those of
the uninterrupted run (the second one also needs the Adam moments). fp32 on CPU: ~1e-7 relative noise.
"""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import global_batch, tiny_config, tiny_gpt, train_step
from tests.parallel.dist_utils import run_distributed

ITERS = 10
RTOL = 1e-5


def _build(tp, fsdp2, pp=1):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(1234)
    cfg = tiny_config(ffn_hidden_size=64, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                      sequence_parallel=tp > 1)
    wrapper = TorchFullyShardedDataParallel if fsdp2 else DistributedDataParallel
    model = wrapper(cfg, DistributedDataParallelConfig(bucket_size=4000), tiny_gpt(cfg))
    opt = get_megatron_optimizer(OptimizerConfig(lr=3e-3, weight_decay=0.01, clip_grad=1.0), [model])
    return model, opt


def _step(model, opt, it):
    """One step on the layout-independent global batch of iteration ``it``: (mean loss, grad norm)."""
    return train_step(model, opt, global_batch(it))


def _sharded(model, opt, is_loading=False):
    model_sd = model.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading)}


def _train(tp, fsdp2):
    model, opt = _build(tp, fsdp2)
    curve = [_step(model, opt, it) for it in range(ITERS)]
    ps.destroy_model_parallel()
    return curve


def _save(ckpt, tp, fsdp2):
    """Train 2 steps, save, return the next 2 losses."""
    from megatron.core import dist_checkpointing
    model, opt = _build(tp, fsdp2)
    for it in range(2):
        _step(model, opt, it)
    dist_checkpointing.save(_sharded(model, opt), ckpt)
    expected = [_step(model, opt, it)[0] for it in (2, 3)]
    ps.destroy_model_parallel()
    return expected


def _load(ckpt, tp, fsdp2):
    """Load ``ckpt`` as load_checkpoint does (into the unwrapped model) and train steps 2 and 3."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model
    model, opt = _build(tp, fsdp2)
    loaded = dist_checkpointing.load(_sharded(model, opt, is_loading=True), ckpt)
    unwrap_model(model).load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    losses = [_step(model, opt, it)[0] for it in (2, 3)]
    ps.destroy_model_parallel()
    return losses


def _pp_rejected():
    try:
        _build(tp=1, fsdp2=True, pp=2)
    except NotImplementedError as e:
        return str(e)
    finally:
        ps.destroy_model_parallel()
    return None


def four_ranks(base):
    out = {"curve": _train(tp=2, fsdp2=True), "pp_error": _pp_rejected()}
    out["expected"] = _save(f"{base}/fsdp2", tp=2, fsdp2=True)
    out["loads"] = {"fsdp2": _load(f"{base}/fsdp2", tp=2, fsdp2=True),
                    "ddp_tp2": _load(f"{base}/fsdp2", tp=2, fsdp2=False),
                    "ddp_tp1": _load(f"{base}/fsdp2", tp=1, fsdp2=False)}
    out["ddp_expected"] = _save(f"{base}/ddp", tp=1, fsdp2=False)
    out["ddp_to_fsdp2"] = _load(f"{base}/ddp", tp=2, fsdp2=True)
    return out


def one_rank(base):
    return {"curve": _train(tp=1, fsdp2=False), "single": _load(f"{base}/fsdp2", tp=1, fsdp2=False)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("fsdp2"))
    four = run_distributed(four_ranks, 4, base)
    return four, run_distributed(one_rank, 1, base)[0]


def _close(name, got, expected):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=RTOL, atol=0, msg=lambda m: f"{name}: {m}")


def test_tp2_dp2_fsdp2_matches_single_rank(results):
    four, single = results
    ref_losses, ref_norms = zip(*single["curve"])
    for rank_result in four:
        losses, norms = zip(*rank_result["curve"])
        _close("loss", losses, ref_losses)
        _close("grad norm", norms, ref_norms)


def test_fsdp2_checkpoint_loads_under_other_layouts(results):
    four, single = results
    for rank_result in four:
        for name, got in rank_result["loads"].items():
            _close(name, got, rank_result["expected"])
        _close("ddp_to_fsdp2", rank_result["ddp_to_fsdp2"], rank_result["ddp_expected"])
    _close("single", single["single"], four[0]["expected"])


def test_fsdp2_rejects_pipeline_parallelism(results):
    for rank_result in results[0]:
        assert "--pipeline-model-parallel-size" in rank_result["pp_error"]
