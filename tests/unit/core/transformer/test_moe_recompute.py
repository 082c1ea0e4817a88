"""Selective recompute of MoE layers, Megatron's split: --recompute-modules moe recomputes the MoE layers (router,
exchange, experts and the balancing loss replayed: the same losses bitwise on CPU), mlp only the dense MLPs, and
--moe-layer-recompute is the older spelling of moe."""
import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import single_rank, tiny_config, tiny_gpt
from tests.unit.core.transformer.test_transformer_block import adamw_losses
from tests.unit.training.arguments.test_arguments import _args


def _model(**extra):
    single_rank()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    cfg = tiny_config(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, add_bias_linear=False,
                      hidden_dropout=0.1, **extra)
    return tiny_gpt(cfg, spec=get_gpt_layer_local_spec(num_experts=4))


@pytest.mark.parametrize("modules,recomputed", [(["moe"], True), (["mlp"], False), (["core_attn", "moe"], True)])
def test_moe_module_recomputes_the_moe_layers(modules, recomputed):
    model = _model(recompute_granularity="selective", recompute_modules=modules)
    assert [layer.recompute_mlp for layer in model.decoder.layers] == [recomputed] * 2
    assert adamw_losses(model) == adamw_losses(_model())


def test_moe_layer_recompute_flag():
    args = _args("--num-experts 4 --moe-layer-recompute")
    assert args.recompute_granularity == "selective" and args.recompute_modules == ["core_attn", "moe"]
    args = _args("--num-experts 4 --moe-layer-recompute --recompute-granularity selective --recompute-modules mlp moe")
    assert args.recompute_modules == ["mlp", "moe"]
