"""Resharding a real GPTModel + Megatron optimizer checkpoint between parallel layouts.

Each case trains 2 steps under the saving layout, saves model + optimizer state through
dist_checkpointing (what `save_checkpoint` writes), and records the next 2 losses. A fresh model under
the loading layout loads the checkpoint and trains the same 2 steps: equal losses (fp32, summation-order
noise only) show the weights loaded; equal second-step losses show the Adam moments loaded too (a fresh
optimizer state would change the first update). Dropout is off so layouts see the same computation.
"""
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import global_batch, tiny_config, tiny_gpt, train_step
from tests.parallel.dist_utils import run_distributed

LAYERS = 4
RTOL = 1e-5


def _build(tp, pp, distopt):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(1234)
    cfg = tiny_config(num_layers=LAYERS, ffn_hidden_size=64, tensor_model_parallel_size=tp,
                      pipeline_model_parallel_size=pp)
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=distopt,
                                                                       bucket_size=4000), tiny_gpt(cfg))
    opt = get_megatron_optimizer(OptimizerConfig(lr=3e-3, weight_decay=0.01, clip_grad=1.0,
                                                 use_distributed_optimizer=distopt), [model])
    return model, opt


def _step(model, opt, it):
    """One training step on the layout-independent global batch of iteration ``it``; the mean loss."""
    return train_step(model, opt, global_batch(it))[0]


def _sharded(model, opt, is_loading=False):
    model_sd = model.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading)}


def _save_case(ckpt, layout):
    """Train 2 steps under ``layout``, save, return the next 2 losses."""
    from megatron.core import dist_checkpointing
    model, opt = _build(**layout)
    for it in range(2):
        _step(model, opt, it)
    dist_checkpointing.save(_sharded(model, opt), ckpt)
    expected = [_step(model, opt, it) for it in (2, 3)]
    ps.destroy_model_parallel()
    return expected


def _load_case(ckpt, layout):
    """Load ``ckpt`` under ``layout`` (as load_checkpoint does) and return the losses of steps 2 and 3."""
    from megatron.core import dist_checkpointing
    model, opt = _build(**layout)
    loaded = dist_checkpointing.load(_sharded(model, opt, is_loading=True), ckpt)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    losses = [_step(model, opt, it) for it in (2, 3)]
    ps.destroy_model_parallel()
    return losses


def _cases(base, cases):
    """[(expected, got)] for each (name, save layout, load layout), all on these ranks."""
    out = []
    for name, save, load in cases:
        ckpt = f"{base}/{name}"
        out.append((name, _save_case(ckpt, save), _load_case(ckpt, load)))
    return out


def _load_only(base, cases):
    return [(name, _load_case(f"{base}/{name}", load)) for name, load in cases]


def _assert_close(name, got, expected):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL, atol=0,
                               msg=lambda m: f"{name}: {m}")


TP2 = dict(tp=2, pp=1, distopt=False)
DP2_DISTOPT = dict(tp=1, pp=1, distopt=True)  # TP=1 on 2 ranks is DP=2
PP2 = dict(tp=1, pp=2, distopt=False)
SINGLE = dict(tp=1, pp=1, distopt=False)


def _two_rank_results(base):
    cases = [("tp2_to_tp1dp2", TP2, DP2_DISTOPT),      # TP=2 -> TP=1, plain -> distributed optimizer
             ("dp2distopt_to_tp2", DP2_DISTOPT, TP2),  # TP=1 -> TP=2, distributed -> plain optimizer
             ("pp2_to_dp2", PP2, DP2_DISTOPT),          # PP=2 -> PP=1
             ("dp2distopt_to_pp2", DP2_DISTOPT, PP2)]   # each DP rank's optimizer range -> PP=2, DP=1
    return run_distributed(_cases, 2, base, cases)


def test_reshard_two_ranks_and_to_one_rank(tmp_path):
    base = str(tmp_path)
    per_rank = _two_rank_results(base)
    expected = {}
    for rank_results in per_rank:
        for name, exp, got in rank_results:
            _assert_close(name, got, exp)
            expected[name] = exp
    # Every 2-rank checkpoint loads on one rank without the distributed optimizer (DP=2 distopt -> DP=1).
    single = run_distributed(_load_only, 1, base, [(n, SINGLE) for n in expected])[0]
    for name, got in single:
        _assert_close(f"{name}->single", got, expected[name])


def _tp2pp2_case(base):
    return _cases(base, [("tp2pp2_to_dp4", dict(tp=2, pp=2, distopt=True), DP2_DISTOPT),
                         ("dp4_to_tp2pp2", SINGLE, dict(tp=2, pp=2, distopt=False)),
                         # TP=2 x DP=2 with the distributed optimizer (each DP rank writes its own ranges) -> PP=2
                         ("tp2dp2distopt_to_pp2dp2", dict(tp=2, pp=1, distopt=True), dict(tp=1, pp=2, distopt=True))])


def test_reshard_tp2_pp2_to_tp1_and_back(tmp_path):
    for rank_results in run_distributed(_tp2pp2_case, 4, str(tmp_path)):
        for name, exp, got in rank_results:
            _assert_close(name, got, exp)
