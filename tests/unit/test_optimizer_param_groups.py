"""get_megatron_optimizer's param groups: no weight decay on biases and 1-D params, decoupled LR
for embedding/output weights, and per-group max_lr/min_lr/wd_mult/lr_mult for the scheduler."""
import pytest
import torch

from megatron.core.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params, OptimizerConfig, get_megatron_optimizer


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(10, 4)
        self.fc = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.to(dtype)


def _groups(opt):
    return {(g["wd_mult"], g["is_decoupled_lr"]): g for g in opt.param_groups}


def test_weight_decay_and_decoupled_groups():
    opt = get_megatron_optimizer(OptimizerConfig(lr=1.0, min_lr=0.1, decoupled_lr=5.0, weight_decay=0.1), [Net()])
    assert isinstance(opt, FP32Optimizer)
    groups = _groups(opt)
    assert set(groups) == {(1.0, True), (1.0, False), (0.0, False)}
    assert groups[(1.0, True)]["max_lr"] == 5.0 and groups[(1.0, True)]["min_lr"] == 0.1
    assert len(groups[(0.0, False)]["params"]) == 3  # fc.bias, norm.weight, norm.bias
    assert groups[(0.0, False)]["weight_decay"] == 0.0 and groups[(1.0, False)]["weight_decay"] == 0.1


def test_lr_mult_and_custom_conditions():
    opt = get_megatron_optimizer(OptimizerConfig(lr=1.0), [Net()], no_weight_decay_cond=lambda n, p: False,
                                 scale_lr_cond=lambda n, p: n.startswith("fc"), lr_mult=0.5)
    mults = sorted((g["wd_mult"], g["lr_mult"], len(g["params"])) for g in opt.param_groups)
    assert mults == [(1.0, 0.5, 2), (1.0, 1.0, 3)]


def test_bf16_model_gets_fp32_main_params():
    model = Net(torch.bfloat16)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1.0, bf16=True), [model])
    assert isinstance(opt, Float16OptimizerWithFloat16Params)
    assert all(p.dtype == torch.float32 for p in opt.get_parameters())
    assert opt.grad_scaler is None and opt.get_loss_scale().item() == 1.0


def test_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--optimizer"):
        OptimizerConfig(optimizer="lamb")
    with pytest.raises(ValueError, match="--lr"):
        get_megatron_optimizer(OptimizerConfig(), [Net()])
