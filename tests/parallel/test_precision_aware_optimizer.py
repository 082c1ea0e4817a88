"""--use-precision-aware-optimizer at DP=2 (gloo) with the distributed optimizer, bf16 model params:
- with every dtype fp32 the run is the plain distributed optimizer's, bit for bit (the grads reach Adam as the
  grad buffer's own shard, `decoupled_grad`, instead of a copy; the update is torch's AdamW);
- with bf16 main grads and bf16 moments the grad buffer is bf16, the state is kept in those dtypes and the
  run stays within bf16 rounding of the fp32 run;
- a torch_dist checkpoint saved with 16-bit state loads into an fp32-state optimizer (and back) with the values
  it saved."""
import torch
import torch.distributed as dist

from tests.parallel.dist_utils import run_distributed
from tests.parallel.test_ddp_invariance import CLIP, GBS, ITERS, LR, TinyNet, _data

WORLD = 2
FP32 = dict(main_grads_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32)
LOW = dict(main_grads_dtype=torch.bfloat16, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)


def _build(precision_aware, dtypes):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               grad_reduce_in_fp32=dtypes["main_grads_dtype"] == torch.float32)
    model = DistributedDataParallel(None, ddp_config, TinyNet(torch.bfloat16))
    model.broadcast_params()
    extra = dict(use_precision_aware_optimizer=True, **dtypes) if precision_aware else {}
    config = OptimizerConfig(lr=LR, weight_decay=0.1, clip_grad=CLIP, bf16=True, use_distributed_optimizer=True,
                             **extra)
    return model, get_megatron_optimizer(config, [model])


def _train(model, opt, iters=ITERS):
    from megatron.core.distributed import finalize_model_grads

    rank = dist.get_rank()
    xs, ys = _data()
    local = GBS // WORLD
    losses = []
    for it in range(iters):
        model.zero_grad_buffer()
        opt.zero_grad()
        x, y = xs[it, rank * local:(rank + 1) * local], ys[it, rank * local:(rank + 1) * local]
        loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        loss.backward()
        finalize_model_grads([model])
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    model.finish_param_sync()
    return losses, [p.detach().float().clone() for p in model.module.parameters()]


def _runs():
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    out = {}
    for name, (aware, dtypes) in {"plain": (False, FP32), "aware_fp32": (True, FP32), "aware_low": (True, LOW)}.items():
        model, opt = _build(aware, dtypes)
        losses, params = _train(model, opt)
        states = [s for s in opt.optimizer.state.values()]
        out[name] = dict(losses=losses, params=params,
                         grad_dtypes={b.grad_data.dtype for b in model.buffers},
                         state_dtypes={(k, t.dtype) for s in states for k, t in s.items() if k != "step"},
                         decoupled=all(getattr(p, "decoupled_grad", None) is not None or p.grad is None
                                       for g in opt.optimizer.param_groups for p in g["params"]) if aware else None)
    return out


def test_fp32_dtypes_equal_the_plain_optimizer_and_16_bit_state_stays_close():
    for rank_out in run_distributed(_runs, WORLD):
        plain, same, low = rank_out["plain"], rank_out["aware_fp32"], rank_out["aware_low"]
        assert same["losses"] == plain["losses"]
        assert all(torch.equal(a, b) for a, b in zip(same["params"], plain["params"]))
        assert same["decoupled"] and low["decoupled"]
        assert plain["grad_dtypes"] == {torch.float32} and low["grad_dtypes"] == {torch.bfloat16}
        assert low["state_dtypes"] == {("exp_avg", torch.bfloat16), ("exp_avg_sq", torch.bfloat16)}
        assert same["state_dtypes"] == {("exp_avg", torch.float32), ("exp_avg_sq", torch.float32)}
        # bf16 grads and moments move each step's update by ~2^-8 relative: the params stay within a few bf16
        # ulps of the fp32-state run after ITERS steps, and the losses within 1%.
        for a, b in zip(low["params"], plain["params"]):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
        for a, b in zip(low["losses"], plain["losses"]):
            assert abs(a - b) <= 1e-2 * abs(b), (low["losses"], plain["losses"])
        assert not all(torch.equal(a, b) for a, b in zip(low["params"], plain["params"]))  # the 16 bits did act


def _states(opt):
    return [{k: t.clone() for k, t in s.items() if k != "step"} for s in opt.optimizer.state.values()]


def _checkpoint_round_trip(ckpt_dir):
    from megatron.core import dist_checkpointing, parallel_state
    from tests.parallel.test_distributed_optimizer_checkpoint import _sharded, _step
    parallel_state.initialize_model_parallel(1, 1)
    model, opt = _build(True, LOW)
    for it in range(2):
        _step(model, opt, it)
    dist_checkpointing.save(_sharded(model, opt), ckpt_dir)
    saved = _states(opt)
    expected_loss = _step(model, opt, 2)
    out = {}
    for name, target in (("low", LOW), ("fp32", FP32)):
        model2, opt2 = _build(True, target)
        loaded = dist_checkpointing.load(_sharded(model2, opt2, is_loading=True), ckpt_dir)
        model2.module.load_state_dict(loaded["model"])
        opt2.reload_model_params()
        opt2.load_state_dict(loaded["optimizer"])
        got = _states(opt2)
        # Saved in fp32: the 16-bit values come back exactly, as 16-bit or as fp32.
        same = all(torch.equal(g[k].float(), w[k].float()) for g, w in zip(got, saved) for k in w)
        dtypes = {t.dtype for s in got for t in s.values()}
        out[name] = (same, dtypes, _step(model2, opt2, 2) == expected_loss if name == "low" else None)
    return out


def test_checkpoint_with_16_bit_state_resumes_exactly_and_loads_into_fp32_state(tmp_path):
    for per_rank in run_distributed(_checkpoint_round_trip, WORLD, str(tmp_path)):
        assert per_rank["low"] == (True, {torch.bfloat16}, True)
        assert per_rank["fp32"] == (True, {torch.float32}, None)
