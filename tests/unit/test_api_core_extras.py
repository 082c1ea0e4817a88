"""Megatron Core names used the way Megatron's code and docs use them, single process: recompute without
output, the frozen-weight linear, the cross-entropy steps, schedule helpers, optimizer config overrides,
clipping and zero counting by parameters, checkpoint factories / validation / integrity, batch helpers."""
import dataclasses
import os
import typing

import pytest
import torch
import torch.nn.functional as F

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from tests.fixtures.tiny_gpt import tiny_config


def test_checkpoint_without_output_matches_plain_backward():
    """Recomputed dropout output (same RNG states) gives the plain graph's gradients exactly; the
    output's storage is freed until the recompute hook runs."""
    from megatron.core.tensor_parallel import CheckpointWithoutOutput
    from megatron.core.tensor_parallel.random import is_checkpointing
    seen = []

    def f(a, w):
        seen.append(is_checkpointing())
        return F.dropout(torch.tanh(a @ w), 0.3)

    def tail(y):
        return (y * y).sum(-1, keepdim=True) * y  # saves y for its backward

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    torch.manual_seed(1)
    ref = torch.autograd.grad(tail(f(x, w)).sum(), (x, w))
    torch.manual_seed(1)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(f, x, w)
    z = tail(y)
    ckpt.discard_output_and_register_recompute(z)
    assert y.untyped_storage().size() == 0
    torch.manual_seed(7)  # the recompute must not depend on the RNG state at backward time
    got = torch.autograd.grad(z.sum(), (x, w))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same ops, same masks: bitwise equal
    assert seen == [False, True, True] and not is_checkpointing()


def test_frozen_weight_linear_and_cross_entropy_steps():
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as S
    from megatron.core.tensor_parallel.layers import linear_with_frozen_weight
    x, w, b = torch.randn(3, 2, 5, requires_grad=True), torch.randn(7, 5, requires_grad=True), torch.randn(7)
    y = linear_with_frozen_weight(x, w, b, False, False, False, None)
    torch.testing.assert_close(y, F.linear(x, w, b))
    y.sum().backward()
    assert w.grad is None
    torch.testing.assert_close(x.grad, torch.ones(3, 2, 7) @ w.detach())
    # Megatron's step functions composed as its fused cross entropy composes them (one rank).
    z, t = torch.randn(4, 11), torch.randint(0, 11, (4,))
    logits, mx = S.calculate_logits_max(z)
    mask, mt1d, pred, sum_exp, exp = S.calculate_predicted_logits(logits, t, mx, 0, 11)
    softmax, loss = S.calculate_cross_entropy_loss(exp, pred, sum_exp)
    torch.testing.assert_close(loss, F.cross_entropy(z, t, reduction="none"))
    g2d, ar, upd, gin = S.prepare_gradient_calculation_operands(softmax, mask)
    grad = S.calculate_gradients(g2d, ar, mt1d, upd, gin, torch.ones(4))
    zz = z.clone().requires_grad_()
    F.cross_entropy(zz, t, reduction="sum").backward()
    torch.testing.assert_close(grad, zz.grad)


def _tiny_gpt_config():
    return tiny_config(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)


def test_schedule_helpers_and_forward_step():
    from megatron.core.pipeline_parallel import schedules as S
    assert S.get_schedule_table(5, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1),
                                            (4, 0), (4, 1)]
    assert S.get_pp_rank_microbatches(4, 1, 1) == (4, False, 0, 4)  # PP=1: no warm-up
    assert S.get_pp_rank_microbatches(4, 2, 1, forward_only=True) == (8, True, 8, 0)
    assert S.check_first_val_step(False, True, True) is False and S.check_first_val_step(None, True, True)
    assert S.get_tensor_device({"a": torch.zeros(1)}) == torch.device("cpu")
    cfg = _tiny_gpt_config()
    assert S.get_tensor_shapes(seq_length=8, micro_batch_size=2, decoder_seq_length=None, config=cfg) == [(8, 2, 16)]

    model = torch.nn.Linear(4, 1)
    model.config, model.set_input_tensor = cfg, lambda t: None
    data = [torch.randn(3, 4) for _ in range(2)]

    def step(it, m):
        out = m(next(it)).squeeze(-1)
        return out, lambda o: (o.pow(2).sum(), torch.tensor(3), {"lm loss": o.pow(2).mean().detach()})

    store = []
    out, n = S.forward_step(step, iter(data), model, 2, None, store, cfg, 1)
    # Token-weighted loss: divided by its token count and by the micro-batch count.
    torch.testing.assert_close(out, model(data[0]).pow(2).sum() / 3 / 2)
    assert int(n) == 3 and len(store) == 1
    out, n = S.forward_step_calc_loss(model, torch.ones(2), None, cfg, None, False, 2, store, 1, True)
    assert torch.equal(store[-1], torch.ones(2))  # no loss_func: the output itself is collected


def test_optimizer_config_overrides():
    """get_standard_config_overrides reproduces the default groups; MuP overrides scale hidden LR and
    Adam eps; per-group start_wd/end_wd reach the scheduler; the canonical LR is the default group's."""
    from megatron.core.optimizer import (
        OptimizerConfig,
        ParamKey,
        check_config_overrides_consistency,
        get_megatron_optimizer,
        get_mup_config_overrides,
        get_standard_config_overrides,
    )
    from megatron.core.optimizer_param_scheduler import (
        OptimizerParamScheduler,
        combine_param_group_overrides,
        get_canonical_lr_for_logging,
    )
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    config = OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.1)

    def groups(opt):
        return sorted((tuple(sorted(p.shape for p in g["params"])), g["wd_mult"], g["max_lr"])
                      for g in opt.param_groups if g["params"])

    default = get_megatron_optimizer(config, [model])
    standard = get_megatron_optimizer(config, [model], config_overrides=get_standard_config_overrides(config))
    assert groups(default) == groups(standard)
    mup = get_megatron_optimizer(config, [model], config_overrides=get_mup_config_overrides(config, 4.0))
    hidden = [g for g in mup.param_groups if any(p.dim() == 2 for p in g["params"])][0]
    assert hidden["max_lr"] == pytest.approx(config.lr / 4) and hidden["eps"] == pytest.approx(config.adam_eps / 4)
    assert not hidden["default_config"]
    wd = {ParamKey(name="2.weight"): {"start_wd": 0.0, "end_wd": 0.2}}
    opt = get_megatron_optimizer(config, [model], config_overrides=wd)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=0,
                                    lr_decay_steps=10, lr_decay_style="linear", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=10, wd_incr_style="linear")
    sched.step(5)
    special = [g for g in opt.param_groups if g.get("end_wd") == 0.2][0]
    assert special["weight_decay"] == pytest.approx(0.1)  # halfway from 0 to 0.2
    assert get_canonical_lr_for_logging(opt.param_groups) == pytest.approx(sched.get_lr({}))
    with pytest.raises(ValueError, match="Conflicting"):
        combine_param_group_overrides([{"max_lr": 1.0}, {"max_lr": 2.0}])
    with pytest.raises(ValueError, match="optimizer"):
        check_config_overrides_consistency(config, {ParamKey(name="*"): {"optimizer": "sgd"}})


def test_clip_and_count_zeros_by_parameters():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, count_zeros_fp32
    from megatron.core.optimizer.optimizer import ProxyDict
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 4.0]), torch.tensor([0.0, 0.0])
    assert count_zeros_fp32([a, b], None) == 3
    clip_grad_by_total_norm_fp32([a, b], max_norm=1.0, total_norm=5.0)
    torch.testing.assert_close(a.grad, torch.tensor([3.0, 0.0, 4.0]) / (5.0 + 1e-6))
    b.decoupled_grad = torch.tensor([2.0, 2.0])
    clip_grad_by_total_norm_fp32([b], 1.0, torch.tensor(3.0), use_decoupled_grad=True)
    torch.testing.assert_close(b.decoupled_grad, torch.full((2,), 2.0 / 3.0))
    proxy = ProxyDict([{"x": 1}, {"y": 2}])
    assert dict(proxy.items()) == {(0, "x"): 1, (1, "y"): 2} and proxy[1, "y"] == 2 and len(proxy) == 2


def _swiglu_factory(key, w):
    """Megatron's use of factories: a fused [gate; up] weight saved as two tensors."""
    def build(k, t, replica_id, flattened_range):
        gate, up = t.chunk(2)
        return {"gate": ShardedTensor.from_rank_offsets(k + ".gate", gate, replica_id=replica_id),
                "up": ShardedTensor.from_rank_offsets(k + ".up", up, replica_id=replica_id)}

    return dc.ShardedTensorFactory(key, w, build, lambda sub: torch.cat([sub["gate"], sub["up"]]))


def test_factory_round_trip_validation_and_integrity(tmp_path):
    from megatron.core.dist_checkpointing import validation as V
    ckpt = str(tmp_path / "c")
    w = torch.randn(6, 3)
    dc.save({"w": _swiglu_factory("fc1", w), "rng": ShardedObject("rng", 5, (1,), (0,))}, ckpt,
            verify_integrity=True)
    assert set(dc.load_tensors_metadata(ckpt)) == {"fc1.gate", "fc1.up"}
    meta = dc.load_sharded_metadata(ckpt)
    assert meta["fc1.up"].global_shape == (3, 3) and meta["rng/shard_0_1"].key == "rng"
    out = dc.load({"w": _swiglu_factory("fc1", torch.empty(6, 3)), "rng": ShardedObject("rng", None, (1,), (0,))},
                  ckpt, verify_integrity=True)
    assert torch.equal(out["w"], w) and out["rng"] == 5
    # Coverage check: two main replicas of one chunk, or a missing chunk, are invalid.
    halves = [ShardedTensor.from_rank_offsets("t", torch.zeros(2), (0, r, 2)) for r in range(2)]
    V.validate_sharding_integrity([[halves[0]], [halves[1]]])
    with pytest.raises(dc.CheckpointingException):
        V.validate_sharding_integrity([[halves[0]], [halves[0]]])
    sd, missing, unexpected = V.validate_integrity_and_strict_load(
        {"a": ShardedTensor.from_rank_offsets("nope", torch.zeros(1))}, V.StrictHandling.RETURN_ALL, False,
        global_metadata=[[]], ckpt_sharded_metadata=meta)
    assert sd == {} and unexpected == {"nope"} and missing == {"fc1.gate", "fc1.up", "rng"}
    with open(os.path.join(ckpt, "common.pt"), "ab") as f:
        f.write(b"x")
    with pytest.raises(dc.CheckpointingException, match="common.pt"):
        V.verify_integrity_manifest(ckpt)


def test_batch_buffer_and_wgrad_helpers():
    from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers, shard_buffer
    from megatron.core.utils import (
        drain_embedding_wgrad_compute,
        flatten_batch_for_packed_sequences,
        prepare_input_tensors_for_wgrad_compute,
    )
    batch = {"tokens": torch.arange(8).view(2, 4), "labels": torch.arange(8).view(2, 4),
             "cu_seqlens": torch.tensor([[0, 1, 4, 4], [0, 4, 4, 4]], dtype=torch.int32),
             "max_seqlen": torch.tensor([3, 4], dtype=torch.int32)}
    out = flatten_batch_for_packed_sequences(batch)
    assert out["tokens"].shape == (1, 8) and out["cu_seqlens"].tolist() == [[0, 1, 4, 8]]
    assert out["max_seqlen"].tolist() == [4]
    buf = torch.arange(12.0)
    assert [s.tolist() for s in shard_buffer(buf, 3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    p16, p32 = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(2))
    expert = torch.nn.Parameter(torch.zeros(2))
    expert.allreduce = False
    grouped = group_params_for_buffers([p16, p32, expert, p32], grad_reduce_in_fp32=True)
    assert {(k.param_dtype, k.is_expert_parallel): v[1] for k, v in grouped.items()} == {
        (torch.bfloat16, False): [0], (torch.float32, False): [0, 1], (torch.float32, True): [0]}
    w = torch.nn.Parameter(torch.zeros(5, 3))
    w.main_grad = torch.zeros(5, 3)
    xs, gs = [torch.randn(2, 1, 3) for _ in range(3)], [torch.randn(2, 1, 5) for _ in range(3)]
    expected = sum(g.reshape(-1, 5).t() @ x.reshape(-1, 3) for x, g in zip(xs, gs))
    assert prepare_input_tensors_for_wgrad_compute(gs[0], xs[0])[0].shape == (2, 5)
    drain_embedding_wgrad_compute(_tiny_gpt_config(), list(xs), list(gs), w, None)
    torch.testing.assert_close(w.main_grad, expected)


def test_megatron_metadata_class_unpickles(tmp_path):
    """A .metadata pickled as Megatron Core 0.15's MCoreMetadata (optimizer-state checkpoints) loads."""
    import pickle

    from megatron.core.dist_checkpointing.strategies.torch import MCoreMetadata
    ckpt = str(tmp_path / "c")
    w = torch.randn(4, 2)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, ckpt)
    path = os.path.join(ckpt, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    legacy = MCoreMetadata()
    legacy.__dict__.update(vars(md))
    with open(path, "wb") as f:
        pickle.dump(legacy, f)
    assert torch.equal(dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 2))}, ckpt)["w"], w)


def test_async_callers_single_process():
    from megatron.core.dist_checkpointing.strategies.async_utils import (
        AsyncRequest,
        PersistentAsyncCaller,
        TemporalAsyncCaller,
    )
    order = []
    for caller in (TemporalAsyncCaller(), PersistentAsyncCaller()):
        for tag in ("a", "b"):
            caller.schedule_async_call(AsyncRequest(order.append, (tag,)))
            assert caller.is_current_async_call_done(blocking=True, no_dist=True)
        caller.close()
    assert order == ["a", "b", "a", "b"]
    # Megatron's field order: (fn, args, finalize_fns, kwargs); preload_fn's result becomes args[1].
    got = []
    request = AsyncRequest(lambda a, b, k=0: got.append((a, b, k)), (1, 2), [], {"k": 5}, lambda: 9).freeze()
    request.execute_sync()
    assert got == [(1, 9, 5)]
    with pytest.raises(RuntimeError, match="frozen"):
        request.add_finalize_fn(print)


def test_small_training_and_core_helpers(tmp_path):
    import argparse

    from megatron.core.dist_checkpointing.strategies.torch import flatten_state_dict
    from megatron.core.model_parallel_config import resolve_tensor_parallel_weight_shards
    from megatron.core.optimizer import is_managed_by_layer_wise_optimizer
    from megatron.core.pipeline_parallel.schedules import backward_step_multimodule
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        get_data_parallel_rng_tracker_name,
        model_parallel_cuda_manual_seed,
    )
    from megatron.training.argument_utils import ArgumentGroupFactory, TypeInferenceError
    from megatron.training.utils import append_to_progress_log
    assert resolve_tensor_parallel_weight_shards(2, None, 1) == (2, 1)
    assert resolve_tensor_parallel_weight_shards(2, 8, 1) == (8, 4)
    with pytest.raises(ValueError, match="multiple"):
        resolve_tensor_parallel_weight_shards(4, 6, 1)
    emb = torch.nn.Parameter(torch.zeros(3, 2))
    emb.is_embedding_or_output_parameter = True
    assert is_managed_by_layer_wise_optimizer(torch.nn.Parameter(torch.zeros(3, 2)))
    assert not is_managed_by_layer_wise_optimizer(emb) and not is_managed_by_layer_wise_optimizer(torch.zeros(3))
    # Dict-of-modules backward: the language model's loss alone on the last stage.
    enc_in, lm_in = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)
    loss = (enc_in * 3).sum() + (lm_in * 2).sum()
    grads = backward_step_multimodule({"enc": enc_in, "lm": [lm_in]}, loss, None, _tiny_gpt_config(), "lm")
    assert torch.equal(grads["enc"], torch.full((2,), 3.0)) and torch.equal(grads["lm"], torch.full((2,), 2.0))
    model_parallel_cuda_manual_seed(5)
    with get_cuda_rng_tracker().fork(get_data_parallel_rng_tracker_name()):
        a = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(a, torch.rand(3))  # the data-parallel state is the plain seed, as in Megatron
    get_cuda_rng_tracker().reset()  # leave no seeded tracker behind for other tests
    flat, paths = flatten_state_dict({"a": {"b": 1}, "l": [{"c": 2}]})
    assert flat == {"a.b": 1, "l.0.c": 2} and paths["l.0.c"] == ("l", 0, "c")
    parser = argparse.ArgumentParser()
    ArgumentGroupFactory(_FlagsConfig, exclude=["skip"]).build_group(parser, "demo")
    args = parser.parse_args(["--num-layers", "3", "--no-use-bias", "--sizes", "4", "5", "--mode", "b"])
    assert (args.num_layers, args.use_bias, args.sizes, args.mode, args.fast) == (3, False, [4, 5], "b", False)
    assert "Layers to build." in parser.format_help() and not hasattr(args, "skip")
    with pytest.raises(TypeInferenceError):
        ArgumentGroupFactory(_BadConfig).build_group(argparse.ArgumentParser())
    append_to_progress_log(str(tmp_path), "Starting job")
    line = open(tmp_path / "progress.txt").read()
    assert line.endswith("\tStarting job\n") and "# GPUs: 1" in line


def test_reset_model_temporary_tensors_clears_router_counts():
    from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors
    from megatron.core.transformer.moe.router import TopKRouter
    cfg = tiny_config(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                      moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                      moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.01,
                      use_cpu_initialization=True)
    router = TopKRouter(cfg)
    router.set_layer_number(1)
    router(torch.randn(5, 1, 8))
    assert router.local_tokens_per_expert.sum() == 10 and router.ga_steps == 1  # 5 tokens x top-2
    reset_model_temporary_tensors(cfg, [router])
    assert router.local_tokens_per_expert.sum() == 0 and router.global_tokens_per_expert.sum() == 0
    assert router.ga_steps == 0


@dataclasses.dataclass
class _FlagsConfig:  # module level: ArgumentGroupFactory reads field docstrings from the source
    """Demo flags."""
    num_layers: int = 2
    """Layers to build."""
    use_bias: bool = True
    fast: bool = False
    sizes: typing.List[int] = dataclasses.field(default_factory=lambda: [1])
    mode: typing.Literal["a", "b"] = "a"
    skip: typing.Union[int, str] = 0


@dataclasses.dataclass
class _BadConfig:
    either: typing.Union[int, str] = 0


def test_save_refuses_an_incomplete_sharding(tmp_path):
    """One of two chunks described (validate_access_integrity, on by default): nothing is written."""
    half = ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 0, 2))
    with pytest.raises(dc.CheckpointingException, match="w"):
        dc.save({"w": half}, str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "c" / ".metadata")
    dc.save({"w": half}, str(tmp_path / "d"), validate_access_integrity=False)  # the caller's call
