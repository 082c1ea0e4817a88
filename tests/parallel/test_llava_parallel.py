"""LLaVA under TP=2, PP=2 (encoder on the first stage) and DP=2 with the distributed optimizer trains to the
single-process losses and grad norms: 4 Adam steps of the tiny model, fp32, dropout 0, several images per
sample, loss on the answer tokens only. Layouts differ only in summation order (~1e-7), so 1e-5 relative."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import train_step
from tests.fixtures.tiny_vlm import language_config, tiny_llava, vlm_batch, vlm_forward_step
from tests.parallel.dist_utils import run_distributed

ITERS, MICRO_BATCHES, MBS, MAX_SEQ = 4, 4, 2, 24


def train_llava(tp=1, pp=1, distopt=False, freeze_vit=False):
    ps.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1234)
    language = language_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               pipeline_dtype=torch.float32)
    model = tiny_llava(language, max_seq=MAX_SEQ)
    model.freeze(freeze_language_model=False, freeze_vision_model=freeze_vit, freeze_vision_projection=False)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distopt, bucket_size=4000)
    model = DistributedDataParallel(language, ddp_config, model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=3e-3, clip_grad=1.0, use_distributed_optimizer=distopt),
                                 [model])
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    results = []
    for it in range(ITERS):
        batches = [vlm_batch(100 * it + m) for m in range(MICRO_BATCHES)][dp_rank::dp]
        results.append(train_step(model, opt, batches, forward_step_func=vlm_forward_step, seq=MAX_SEQ, mbs=MBS))
    ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def reference():
    return run_distributed(train_llava, 1)[0]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(distopt=True)], ids=["tp2", "pp2", "dp2_distopt"])
def test_layout_matches_single_process(reference, layout):
    losses = [loss for loss, _ in reference]
    assert losses[-1] < losses[0]  # it trains
    for result in run_distributed(train_llava, 2, **layout):
        assert [loss for loss, _ in result] == pytest.approx(losses, rel=1e-5)
        assert [norm for _, norm in result] == pytest.approx([norm for _, norm in reference], rel=1e-5)


def test_frozen_vit_trains_the_rest_alike_under_dp():
    ref = run_distributed(train_llava, 1, freeze_vit=True)[0]
    for result in run_distributed(train_llava, 2, distopt=True, freeze_vit=True):
        assert [loss for loss, _ in result] == pytest.approx([loss for loss, _ in ref], rel=1e-5)
