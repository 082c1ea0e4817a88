"""Megatron Core names added for API coverage: the types select and convert for real, the parameters
without a feature here are refused with one line at any non-default value. One process, CPU, < 5 s."""
import functools

import pytest
import torch

from tests.fixtures.tiny_gpt import tiny_config


def _config(**kw):
    return tiny_config(use_cpu_initialization=True, **kw)


def test_param_key_selects_by_name_attr_and_predicates():
    from megatron.core.optimizer import ParamKey, ParamPredicate, ParamWithNamePredicate
    p = torch.nn.Parameter(torch.zeros(3))
    p.is_embedding_or_output_parameter = True
    assert ParamKey(name="*.bias").matches(p, "decoder.layers.0.mlp.linear_fc1.bias")
    assert not ParamKey(name=("*.weight",)).matches(p, "decoder.layers.0.mlp.linear_fc1.bias")
    assert ParamKey(attr="is_embedding_or_output_parameter").matches(p, "x")
    assert not ParamKey(attr="sequence_parallel").matches(p, "x")
    assert ParamKey(predicate=ParamPredicate("1d", lambda q: q.ndim == 1)).matches(p, "x")
    assert ParamKey(with_name_predicate=ParamWithNamePredicate("n", lambda q, n: n.endswith("norm"))).matches(p, "a.norm")
    assert not ParamKey().matches(p, "anything")  # no criterion: selects nothing
    assert hash(ParamKey(name=("a", "b"))) == hash(ParamKey(name=("a", "b")))  # usable as a dict key


def test_optimizer_config_subclasses_and_override_tuple():
    from megatron.core.optimizer import AdamOptimizerConfig, SGDOptimizerConfig
    from megatron.core.optimizer_param_scheduler import param_group_override_to_tuple
    assert AdamOptimizerConfig(lr=1e-3).optimizer == "adam" and SGDOptimizerConfig(lr=1e-3).optimizer == "sgd"
    assert param_group_override_to_tuple(None) is None
    assert param_group_override_to_tuple({"wd_mult": 0.0, "max_lr": 1.0}) == (("max_lr", 1.0), ("wd_mult", 0.0))


def test_straggler_detector_is_disabled_and_refuses_enabling():
    from megatron.core.utils import StragglerDetector
    stimer = StragglerDetector()
    with stimer:
        with stimer(bdata=True):
            pass
    assert stimer.report(1.0, 10) is False
    with pytest.raises(NotImplementedError, match="log-straggler"):
        stimer.configure(2, 0, enabled=True)


def test_expert_parallel_setters_override_and_clear():
    from megatron.core import parallel_state as ps
    ps.set_expert_model_parallel_world_size(4)
    ps.set_expert_model_parallel_rank(3)
    ps.set_expert_tensor_parallel_world_size(2)
    ps.set_expert_tensor_parallel_rank(1)
    try:
        assert (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()) == (4, 3)
        assert (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()) == (2, 1)
    finally:
        for setter in (ps.set_expert_model_parallel_world_size, ps.set_expert_model_parallel_rank,
                       ps.set_expert_tensor_parallel_world_size, ps.set_expert_tensor_parallel_rank):
            setter(None)
    assert ps.get_expert_model_parallel_world_size() == 1 and ps.get_expert_tensor_parallel_rank() == 0


def test_local_nonpersistent_object_is_not_saved_and_comes_back_local(tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor
    ckpt = str(tmp_path / "ckpt")
    w = torch.arange(4.0)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", w), "it": LocalNonpersistentObject(5),
                             "n": [1, LocalNonpersistentObject("x")]}, ckpt)
    common = dist_checkpointing.load_common_state_dict(ckpt)
    assert common["it"] is None and common["n"] == [1, None]  # the wrapped values never reach disk
    out = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4)),
                                   "it": LocalNonpersistentObject(7), "n": [1, LocalNonpersistentObject("y")]}, ckpt)
    assert out["it"] == 7 and out["n"] == [1, "y"] and torch.equal(out["w"], w)


def test_spec_helpers():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_mlp_module_spec
    from megatron.core.optimizer.distrib_optimizer import Range
    from megatron.core.pipeline_parallel.p2p_communication import is_single_shape
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec, get_submodules
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer, TransformerLayer
    assert get_mlp_module_spec().module is MLP  # use_te=True (Megatron's default) gives the local MLP
    assert get_submodules(ModuleSpec(module=MLP, submodules="s")) == "s"
    assert get_submodules(functools.partial(MLP, submodules="p")) == "p"
    with pytest.raises(ValueError):
        get_submodules(functools.partial(MLP))
    r = Range(10, 14)
    assert (len(r), r.normalize().start, r.normalize(2).end) == (4, 0, 6)
    assert is_single_shape(torch.Size([2, 3])) and is_single_shape((16, 2, 32)) and not is_single_shape([(1, 2)])
    assert TransformerBlockSubmodules().layer_specs is None
    assert issubclass(TransformerLayer, BaseTransformerLayer)
    with pytest.raises(NotImplementedError, match="kitchen"):
        get_gpt_layer_local_spec(use_kitchen_attention=True)
    with pytest.raises(NotImplementedError, match="use_te_op_fuser"):
        get_mlp_module_spec(use_te_op_fuser=True)


def test_modules_refuse_features_they_lack():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import build_module
    config = _config()
    spec = get_gpt_layer_local_spec()
    layer = build_module(spec, config=config, layer_number=1, name="decoder.layers.0")
    assert layer.name == "decoder.layers.0"
    mtp_layer = build_module(spec, config=config, layer_number=1, is_mtp_layer=True)
    assert mtp_layer.is_mtp_layer and mtp_layer.layer_number == 1
    with pytest.raises(NotImplementedError, match="pp_layer_offset"):
        build_module(spec, config=config, layer_number=1, pp_layer_offset=2)
    with pytest.raises(NotImplementedError, match="pp_layer_offset"):
        build_module(spec.submodules.self_attention, config=config, layer_number=1, pp_layer_offset=2)
    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear, activation_func=torch.nn.GELU)
    with pytest.raises(NotImplementedError, match="activation_func"):
        MLP(config, subs)
    attn = DotProductAttention(config, 1, AttnMaskType.causal_bottom_right)
    q = torch.zeros(4, 1, 4, 8)
    with pytest.raises(NotImplementedError, match="causal_bottom_right"):
        attn(q, q, q)


def test_loaders_refuse_missing_backends(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    from megatron.core.utils import get_batch_on_this_cp_rank
    prefix = str(tmp_path / "d")
    builder = IndexedDatasetBuilder(prefix + ".bin")
    builder.add_item(torch.tensor([1, 2, 3]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    assert len(IndexedDataset(prefix, object_storage_config=None, fast_cache_load=False)) == 1
    with pytest.raises(NotImplementedError, match="S3"):
        IndexedDataset(prefix, s3_config={"bucket": "b"})
    batch = {"tokens": torch.arange(8).view(1, 8)}
    assert get_batch_on_this_cp_rank(batch, False)["tokens"] is batch["tokens"]  # CP size 1: unchanged
    with pytest.raises(NotImplementedError, match="hybrid"):
        get_batch_on_this_cp_rank(batch, is_hybrid_cp=True)


def test_set_startup_timestamps_moves_the_start():
    import megatron.training.training as training
    from megatron.training import set_startup_timestamps
    before = (training._TRAIN_START_TIME, dict(training._STARTUP_TIMESTAMPS))
    try:
        set_startup_timestamps(program_start=123.0, main_entry=124.0)
        assert training._TRAIN_START_TIME == 123.0 and training._STARTUP_TIMESTAMPS["main_entry"] == 124.0
    finally:
        training._TRAIN_START_TIME = before[0]
        training._STARTUP_TIMESTAMPS.update(before[1])


def test_torch_dist_strategy_objects_save_and_load(tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )
    ckpt = str(tmp_path / "ckpt")
    w = torch.arange(6.0).view(2, 3)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", w)}, ckpt,
                            sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=2))
    out = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}, ckpt,
                                  sharded_strategy=get_default_load_sharded_strategy(ckpt))
    assert torch.equal(out["w"], w)
    assert isinstance(get_default_save_sharded_strategy(), TorchDistSaveShardedStrategy)
    with pytest.raises(NotImplementedError, match="cpu_shm_mode"):
        TorchDistSaveShardedStrategy(cpu_shm_mode=True)
    with pytest.raises(ValueError, match="sharded_strategy"):
        dist_checkpointing.load({}, ckpt, sharded_strategy="zarr")
    assert isinstance(TorchDistLoadShardedStrategy(cache_metadata=True), TorchDistLoadShardedStrategy)


def test_rng_tracker_and_t5_helpers():
    from megatron.core.models.T5.t5_model import t5_extended_attention_mask, t5_position_ids
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, initialize_rng_tracker
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    try:
        tracker.add("api-test-rng", 1234)
        initialize_rng_tracker()  # initialized: left alone, as in Megatron
        assert "api-test-rng" in tracker.get_states()
        initialize_rng_tracker(force_reset=True)
        assert not tracker.is_initialized()
        with pytest.raises(NotImplementedError, match="use_te_rng_tracker"):
            initialize_rng_tracker(use_te_rng_tracker=True)
    finally:
        tracker.reset()
        tracker.set_states(states)
    ids = torch.zeros(2, 5, dtype=torch.long)
    assert torch.equal(t5_position_ids(ids), torch.arange(5).expand(2, 5))
    m = torch.ones(2, 5, 5, dtype=torch.bool)
    out = t5_extended_attention_mask([m, None])
    assert out[0].shape == (2, 1, 5, 5) and out[1] is None


def test_optimizer_init_state_fn_creates_missing_state():
    from megatron.core.optimizer import FP32Optimizer, OptimizerConfig
    model = torch.nn.Linear(3, 2)

    def init_state_fn(opt, config):  # Megatron's form: called with the torch optimizer and the config
        w = model.weight
        opt.state[w].update(step=torch.tensor(0.0), exp_avg=torch.full_like(w, config.lr),
                            exp_avg_sq=torch.zeros_like(w))

    inner = torch.optim.AdamW(model.parameters(), lr=0.5)
    opt = FP32Optimizer(inner, OptimizerConfig(lr=0.5), init_state_fn)
    state = opt.param_state_for_save()
    assert torch.equal(state[model.weight]["exp_avg"], torch.full((2, 3), 0.5))
    assert torch.equal(state[model.bias]["exp_avg"], torch.zeros(2))  # left without state: the default


def test_get_all_rng_states_is_the_trackers():
    from megatron.core.tensor_parallel.random import get_all_rng_states, get_cuda_rng_tracker
    assert get_all_rng_states() is get_cuda_rng_tracker().states_
