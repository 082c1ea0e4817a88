"""The ViT classifier of pretrain_vision_classify.py under TP=2 and DP=2 with the distributed optimizer trains
to the single-process losses and grad norms: 4 Adam steps of a tiny ViT (fp32, dropout 0) on fixed images.
Layouts differ only in summation order (~1e-7), so 1e-5 relative."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.vision.vit_classification_model import VitClassificationModel
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from pretrain_vision_classify import loss_func
from tests.fixtures.tiny_gpt import train_step
from tests.parallel.dist_utils import run_distributed

ITERS, MICRO_BATCHES, MBS, IMG, CLASSES = 4, 4, 3, 16, 5


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"images": torch.randn(MBS, 3, IMG, IMG, generator=g), "labels": torch.randint(0, CLASSES, (MBS,),
                                                                                          generator=g)}


def forward_step(data_iterator, model):
    b = next(data_iterator)

    def loss(output):  # the entry point's loss, under the name the shared train_step sums
        total, count, stats = loss_func(b["labels"], output)
        return total, count, {"lm loss": stats["loss"], "accuracy": stats["accuracy"]}
    return model(b["images"]), loss


def train_vit(tp=1, distopt=False):
    ps.initialize_model_parallel(tp)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True, tensor_model_parallel_size=tp,
                               add_qkv_bias=True)
    model = VitClassificationModel(config, get_vit_layer_with_local_spec(), CLASSES, img_h=IMG, img_w=IMG,
                                   patch_dim=4)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=distopt,
                                                                          bucket_size=4000), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=3e-3, clip_grad=1.0, use_distributed_optimizer=distopt),
                                 [model])
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    results = [train_step(model, opt, [batch(100 * it + m) for m in range(MICRO_BATCHES)][dp_rank::dp],
                          forward_step_func=forward_step, seq=(IMG // 4) ** 2 + 1, mbs=MBS) for it in range(ITERS)]
    ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def reference():
    return run_distributed(train_vit, 1)[0]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(distopt=True)], ids=["tp2", "dp2_distopt"])
def test_layout_matches_single_process(reference, layout):
    losses = [loss for loss, _ in reference]
    assert losses[-1] < losses[0]  # it trains
    for result in run_distributed(train_vit, 2, **layout):
        assert [loss for loss, _ in result] == pytest.approx(losses, rel=1e-5)
        assert [norm for _, norm in result] == pytest.approx([norm for _, norm in reference], rel=1e-5)
