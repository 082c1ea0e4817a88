"""--optimizer lion: the step equals a float64 Lion reference; at DP=2 with the distributed optimizer (and with
plain DDP) training equals one process running Lion on the whole batch (fp32, 1e-5); its momentum (`exp_avg`)
round-trips a torch_dist checkpoint so a resumed run continues exactly; Muon takes Lion for its scalar params."""
import pytest
import torch
import torch.distributed as dist

from megatron.core.optimizer.lion import Lion
from tests.parallel.dist_utils import run_distributed
from tests.parallel.test_ddp_invariance import CLIP, GBS, ITERS, LR, TinyNet, _data

BETAS, WD = (0.9, 0.99), 0.1


def test_step_equals_float64_reference():
    torch.manual_seed(0)
    p = torch.randn(7, 5, requires_grad=True)
    ref, m = p.detach().double().clone(), torch.zeros(7, 5, dtype=torch.float64)
    opt = Lion([p], lr=1e-2, betas=BETAS, weight_decay=WD)
    for _ in range(4):
        g = torch.randn(7, 5)
        p.grad = g.clone()
        opt.step()
        ref = ref * (1 - 1e-2 * WD) - 1e-2 * torch.sign(BETAS[0] * m + (1 - BETAS[0]) * g.double())
        m = BETAS[1] * m + (1 - BETAS[1]) * g.double()
    torch.testing.assert_close(p.detach().double(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[p]["exp_avg"].double(), m, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="each beta in"):
        Lion([p], betas=(1.0, 0.9))


def _reference():
    """One process, whole batch, Lion with Megatron's param groups (no decay on 1-D params) and the global clip."""
    model = TinyNet()
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() == 1]
    opt = Lion([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS)
    xs, ys = _data()
    losses = []
    for it in range(ITERS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs[it]), ys[it])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _build(distopt):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    model = DistributedDataParallel(None, DistributedDataParallelConfig(use_distributed_optimizer=distopt), TinyNet())
    model.broadcast_params()
    config = OptimizerConfig(optimizer="lion", lr=LR, weight_decay=WD, clip_grad=CLIP, lion_beta1=BETAS[0],
                             lion_beta2=BETAS[1], use_distributed_optimizer=distopt)
    return model, get_megatron_optimizer(config, [model])


def _step(model, opt, it):
    from megatron.core.distributed import finalize_model_grads
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, ys = _data()
    local = GBS // world
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(xs[it, rank * local:(rank + 1) * local]),
                                        ys[it, rank * local:(rank + 1) * local])
    loss.backward()
    finalize_model_grads([model])
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def _runs(ckpt_dir):
    from megatron.core import dist_checkpointing, parallel_state
    from tests.parallel.test_distributed_optimizer_checkpoint import _sharded
    parallel_state.initialize_model_parallel(1, 1)
    out = {}
    for distopt in (False, True):
        model, opt = _build(distopt)
        losses = [_step(model, opt, it) for it in range(ITERS)]
        model.finish_param_sync()
        out[distopt] = (losses, [p.detach().clone() for p in model.module.parameters()])
    model, opt = _build(True)  # resume: save after 2 steps, load into a fresh optimizer, step 3 as uninterrupted
    for it in range(2):
        _step(model, opt, it)
    dist_checkpointing.save(_sharded(model, opt), ckpt_dir)
    expected = _step(model, opt, 2)
    model2, opt2 = _build(True)
    loaded = dist_checkpointing.load(_sharded(model2, opt2, is_loading=True), ckpt_dir)
    model2.module.load_state_dict(loaded["model"])
    opt2.reload_model_params()
    opt2.load_state_dict(loaded["optimizer"])
    out["resumed"] = (_step(model2, opt2, 2), expected)
    return out


def test_dp2_equals_one_process_and_resumes_exactly(tmp_path):
    ref_losses, ref_params = _reference()
    for per_rank in run_distributed(_runs, 2, str(tmp_path)):
        for distopt in (False, True):
            losses, params = per_rank[distopt]
            for a, b in zip(losses, ref_losses):
                assert abs(a - b) <= 1e-5 * abs(b), (distopt, losses, ref_losses)
            for a, b in zip(params, ref_params):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        resumed, expected = per_rank["resumed"]
        assert resumed == expected


def test_muon_takes_lion_for_its_scalar_params():
    """--optimizer muon --muon-scalar-optimizer lion: the params Muon does not take step with Lion."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.fixtures.tiny_gpt import cpu_reference_config, short_batch, short_gpt, single_rank
    single_rank()
    model = short_gpt(cpu_reference_config())
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1e-2, muon_scalar_optimizer="lion"), [model])
    _, scalar = opt.chained_optimizers
    assert isinstance(scalar.optimizer, Lion) and scalar.optimizer.defaults["betas"] == (0.95, 0.98)
    tokens, pos = short_batch()
    mains = scalar.optimizer.param_groups[0]["params"]
    before = [p.detach().clone() for p in mains]
    model(tokens, pos, None, labels=tokens).sum().backward()
    ok, _, _ = opt.step()
    assert ok and all(not torch.equal(b, p.detach()) for b, p in zip(before, mains))
