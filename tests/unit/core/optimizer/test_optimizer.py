"""get_megatron_optimizer's param groups: no weight decay on biases and 1-D params, decoupled LR
for embedding/output weights, and per-group max_lr/min_lr/wd_mult/lr_mult for the scheduler.

Gradient clipping folded into the fused AdamW kernel (`grad_scale`) equals Megatron's explicit clip:
torch's fused AdamW also runs on CPU, so the folded path, which every CUDA run takes, is checked against
the in-place multiply and against the unfused optimizer."""
import pytest
import torch

from megatron.core.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.training.arguments import parse_args
from megatron.training.arguments.configs import optimizer_config_from_args
from megatron.training.arguments.errors import require
from megatron.training.arguments.optimizer_args import validate_optimizer_args
from tests.fixtures.tiny_gpt import single_rank


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


class QKNormNet(torch.nn.Module):
    """Names as a layer's attention holds them: q_layernorm / k_layernorm beside other norms and biases."""

    def __init__(self):
        super().__init__()
        self.self_attention = torch.nn.Module()
        self.self_attention.q_layernorm = torch.nn.LayerNorm(4)
        self.self_attention.k_layernorm = torch.nn.LayerNorm(4)
        self.self_attention.linear_qkv = torch.nn.Linear(4, 12)
        self.input_layernorm = torch.nn.LayerNorm(4)


def _decayed(opt):
    named = {id(p): n for n, p in QKNET.named_parameters()}
    return sorted(named[id(p)] for g in opt.param_groups if g["wd_mult"] == 1.0 for p in g["params"])


QKNET = QKNormNet()


@pytest.mark.parametrize("apply", [False, True])
def test_apply_wd_to_qk_layernorm(apply):
    """--apply-wd-to-qk-layernorm: the q/k layernorm params (weights and biases, as Megatron's rule matches
    their names) take weight decay; other norms and biases still take none."""
    opt = get_megatron_optimizer(OptimizerConfig(lr=1.0, weight_decay=0.1, apply_wd_to_qk_layernorm=apply), [QKNET])
    qk = ["self_attention.k_layernorm.bias", "self_attention.k_layernorm.weight",
          "self_attention.q_layernorm.bias", "self_attention.q_layernorm.weight"]
    assert _decayed(opt) == sorted((qk if apply else []) + ["self_attention.linear_qkv.weight"])


def test_apply_wd_to_qk_layernorm_flags_reach_the_optimizer_config():
    """The flag and its deprecated spelling (--no-weight-decay-cond-type apply_wd_to_qk_layernorm) set the
    optimizer config's field."""
    base = "--num-layers 2 --hidden-size 8 --num-attention-heads 2 --lr 1e-3".split()
    for flags in (["--apply-wd-to-qk-layernorm"], ["--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"], []):
        args = parse_args(argv=base + flags)
        warned = []
        validate_optimizer_args(args, require, lambda a, m: warned.append(m))
        assert optimizer_config_from_args(args).apply_wd_to_qk_layernorm == bool(flags)
        assert bool(warned) == ("--no-weight-decay-cond-type" in flags)


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


def _run(fused, fold, grad_scale_factor, steps=3):
    single_rank()  # the grad-norm reduction needs a (one-rank) process group
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).bfloat16()
    params = list(model.parameters())
    inner = torch.optim.AdamW([{"params": params}], lr=1e-2, weight_decay=0.1, fused=fused,
                              **({} if fused else {"foreach": False}))
    opt = Float16OptimizerWithFloat16Params(inner, OptimizerConfig(lr=1e-2, clip_grad=1.0, bf16=True))
    if not fold:
        opt._inner_step_unscales_grads = lambda: False
    assert opt._inner_step_unscales_grads() == (fused and fold)
    gen = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * grad_scale_factor).bfloat16()
        ok, norm, _ = opt.step()
        assert ok
        norms.append(float(norm))
    return [p.detach().float().clone() for p in opt.get_parameters()], norms


@pytest.mark.parametrize("grad_scale_factor", [10.0, 1e-3])  # clip active / inactive
def test_folded_clip_matches_explicit_clip(grad_scale_factor):
    folded, norms_f = _run(fused=True, fold=True, grad_scale_factor=grad_scale_factor)
    explicit, norms_e = _run(fused=True, fold=False, grad_scale_factor=grad_scale_factor)
    reference, norms_r = _run(fused=False, fold=False, grad_scale_factor=grad_scale_factor)
    assert norms_f == pytest.approx(norms_e, rel=1e-6) and norms_e == pytest.approx(norms_r, rel=1e-6)
    assert (max(norms_f) > 1.0) == (grad_scale_factor > 1)
    for a, b, c in zip(folded, explicit, reference):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(b, c, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("grad_scale_factor", [10.0, 1e-3])  # clip active / inactive
def test_clip_kept_on_device_matches_host_clip(grad_scale_factor, monkeypatch):
    """Where the Triton AdamW runs (CUDA), the clip scale is computed on the device and the norm is read back
    only after the update is queued. Its small-tensor path (torch's fused AdamW) runs on CPU too, so the
    device-side clip is checked here against the host-side one: the same reported norms, bit for bit, and
    the same params. (The Triton kernel itself is checked on CUDA in tests/gpu/test_fast_path_gpu.py.)"""
    from megatron.core.optimizer import optimizer as optimizer_module
    host, norms_host = _run(fused=True, fold=True, grad_scale_factor=grad_scale_factor)
    monkeypatch.setattr(optimizer_module, "triton_adamw_applies", lambda inner: True)
    calls = []
    real_norm = Float16OptimizerWithFloat16Params.get_grad_norm
    monkeypatch.setattr(Float16OptimizerWithFloat16Params, "get_grad_norm",
                        lambda self, as_tensor=False: calls.append(as_tensor) or real_norm(self, as_tensor))
    device, norms_device = _run(fused=True, fold=True, grad_scale_factor=grad_scale_factor)
    assert calls == [True] * 3  # the device path ran, once per step
    assert norms_device == norms_host
    for a, b in zip(device, host):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
