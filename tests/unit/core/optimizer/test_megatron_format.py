"""Megatron-LM's optimizer checkpoint state <-> ours (megatron/core/optimizer/megatron_format.py)."""
import pytest
import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer import megatron_format

OURS = [{"wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False},
        {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}]


def _megatron_common(kind="fully_reshardable"):
    groups = [{**OURS[1], "lr": 1e-3, "step": 3.0}, {**OURS[0], "lr": 1e-3, "step": 3.0}]
    return {"optimizer": {"param_groups": groups}, "param_state_sharding_type": kind}


def test_groups_are_matched_by_identity_not_position():
    ours = megatron_format.to_our_state({**_megatron_common(), "param_state": {}}, OURS)
    assert [g["wd_mult"] for g in ours["param_groups"]] == [0.0, 1.0]
    assert ours["param_state_sharding_type"] == "fully_reshardable" and "optimizer" not in ours


def test_non_distributed_common_step():
    common = {"optimizer": {"param_groups": [{**g, "params": [i]} for i, g in enumerate(OURS)],
                            "state": {"common_step": torch.tensor(5)}}}
    assert megatron_format.is_megatron_optimizer_state(common)
    groups = megatron_format.groups_to_ours(common, OURS)
    assert [g["step"] for g in groups] == [5.0, 5.0] and all("params" not in g for g in groups)


def test_missing_group_is_one_line():
    with pytest.raises(ValueError, match="no param group with .*--no-load-optim"):
        megatron_format.groups_to_ours(_megatron_common(), [{**OURS[0], "lr_mult": 2.0}])


def test_unknown_sharding_type_is_refused_naming_the_fix():
    megatron_format.check_sharding_type(_megatron_common(), "ckpt")
    megatron_format.check_sharding_type(_megatron_common("dp_reshardable"), "ckpt")
    with pytest.raises(ValueError, match=r"'dp_zero_gather_scatter' format.*--no-load-optim.*--dist-ckpt-optim-fully"):
        megatron_format.check_sharding_type(_megatron_common("dp_zero_gather_scatter"), "ckpt")


def test_state_names_round_trip():
    sh = ShardedTensor.from_rank_offsets("optimizer.state.fp32_param.decoder.layers.0.mlp.linear_fc1.weight",
                                         torch.zeros(2, 3))
    sd = {"param_state": {"k": {"fp32_param": sh}}}
    theirs = megatron_format.rename_state_keys(sd)
    renamed = theirs["param_state"]["k"]["fp32_param"].key
    assert renamed == "optimizer.state.param.decoder.layers.0.mlp.linear_fc1.weight"
    back = megatron_format.rename_state_keys(theirs, to_megatron=False)
    assert back["param_state"]["k"]["fp32_param"].key == sh.key
    assert not megatron_format.is_megatron_optimizer_state({"param_groups": [], "param_state_sharding_type": "x"})


def test_megatron_moe_chained_state_reads_both_optimizers_groups():
    """An MoE model's Megatron optimizer is chained (dense, expert): ``{0: ..., 1: ...}``; ours is one."""
    expert = {**OURS[1], "is_expert_parallel": True}
    chained = {0: _megatron_common(), 1: {"optimizer": {"param_groups": [{**expert, "step": 3.0}]},
                                          "param_state_sharding_type": "fully_reshardable"}}
    assert megatron_format.is_megatron_optimizer_state(chained)
    assert megatron_format.sharding_type(chained) == "fully_reshardable"
    ours = megatron_format.to_our_state({**chained, "param_state": {}}, OURS + [expert])
    assert [g["is_expert_parallel"] for g in ours["param_groups"]] == [False, False, True]
    assert 0 not in ours and 1 not in ours


def _our_sharded(groups):
    sh = ShardedTensor.from_rank_offsets("optimizer.state.fp32_param.decoder.layers.0.mlp.linear_fc1.weight",
                                         torch.zeros(2, 3))
    return {"param_groups": groups, "param_state_sharding_type": "fully_reshardable",
            "param_state": {"decoder.layers.0.mlp.linear_fc1.weight": {"fp32_param": sh}}}


def test_to_megatron_is_what_megatron_saves():
    """The common part as Megatron's DistributedOptimizer.state_dict writes it (torch AdamW groups, one step)."""
    theirs = megatron_format.to_megatron(_our_sharded([{**OURS[0], "lr": 1e-3, "max_lr": 1e-3, "min_lr": 0.0,
                                                        "betas": (0.9, 0.999), "step": 3.0},
                                                       {**OURS[1], "lr": 1e-3, "betas": (0.9, 0.999), "step": 0.0}]))
    groups = theirs["optimizer"]["param_groups"]
    assert [g["step"] for g in groups] == [3.0, 3.0]  # Megatron asserts one step for all groups
    assert all(g["decoupled_weight_decay"] and "params" not in g and g["max_lr"] == 1e-3 for g in groups)
    assert theirs["param_state_sharding_type"] == "fully_reshardable" and "param_groups" not in theirs
    st = theirs["param_state"]["decoder.layers.0.mlp.linear_fc1.weight"]["fp32_param"]
    assert st.key == "optimizer.state.param.decoder.layers.0.mlp.linear_fc1.weight"
    # And back: our loader reads what it wrote.
    assert megatron_format.groups_to_ours(theirs, OURS)[0]["wd_mult"] == 0.0


def test_to_megatron_moe_is_chained_dense_then_expert():
    expert = {**OURS[1], "is_expert_parallel": True, "lr": 1e-3, "step": 2.0}
    theirs = megatron_format.to_megatron(_our_sharded([{**OURS[0], "lr": 1e-3, "step": 2.0}, expert]))
    assert sorted(theirs) == [0, 1]
    assert [g["is_expert_parallel"] for g in theirs[1]["optimizer"]["param_groups"]] == [True]
    assert [g["is_expert_parallel"] for g in theirs[0]["optimizer"]["param_groups"]] == [False]
    assert megatron_format.is_megatron_optimizer_state(theirs)


def test_megatron_local_spec_moe_state_has_experts_in_dense_groups():
    """Megatron's local spec does not mark expert params (no ``allreduce=False``): one optimizer, dense groups.
    Our expert groups read their dense twins, and the way back writes that layout for --transformer-impl local."""
    expert = {**OURS[1], "is_expert_parallel": True}
    groups = megatron_format.groups_to_ours(_megatron_common(), OURS + [expert])
    assert groups[2]["wd_mult"] == 1.0 and groups[2]["is_expert_parallel"] is False
    theirs = megatron_format.to_megatron(_our_sharded([{**OURS[0], "lr": 1e-3, "step": 2.0},
                                                       {**OURS[1], "lr": 1e-3, "step": 2.0},
                                                       {**expert, "lr": 1e-3, "step": 2.0}]), expert_optimizer=False)
    assert [g["is_expert_parallel"] for g in theirs["optimizer"]["param_groups"]] == [False, False]


def test_to_megatron_adds_the_main_param_an_fp32_run_keeps_none_of():
    """Megatron's distributed optimizer always saves an fp32 main param ('param'); ours at fp32 trains the model
    param itself, which the way back saves in its place."""
    weight = torch.ones(2, 3)
    model = {"decoder.layers.0.mlp.linear_fc1.weight": ShardedTensor.from_rank_offsets(
        "decoder.layers.0.mlp.linear_fc1.weight", weight)}
    exp_avg = ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight",
                                              torch.zeros(2, 3))
    ours = {"param_groups": [{**OURS[1], "lr": 1e-3, "step": 1.0}], "param_state_sharding_type": "fully_reshardable",
            "param_state": {"decoder.layers.0.mlp.linear_fc1.weight": {"exp_avg": exp_avg}}}
    entry = megatron_format.to_megatron(ours, model_sharded_sd=model)["param_state"][
        "decoder.layers.0.mlp.linear_fc1.weight"]
    assert entry["param"].key == "optimizer.state.param.decoder.layers.0.mlp.linear_fc1.weight"
    assert entry["param"].data is weight
