"""The expert-load fields of the log line: the busiest and idlest expert, and with expert parallelism the busiest
EP rank, whose expert GEMMs the other ranks wait for in the combine all-to-all."""
import torch

from megatron.core.transformer.moe import moe_logging


def _summary(counts_per_layer, ep_size):
    moe_logging.clear_aux_losses_tracker()
    for layer, counts in enumerate(counts_per_layer, start=1):
        moe_logging.save_expert_load(torch.tensor(counts), layer, len(counts_per_layer))
    return moe_logging._expert_load_summary(len(counts_per_layer), None, ep_size).tolist()


def test_rank_load_sums_each_ranks_block_of_experts():
    # 4 experts on 2 EP ranks: rank 0 holds experts 0-1 (6 tokens), rank 1 experts 2-3 (2): 6 / 4 = 1.5.
    max_load, min_load, rank_load = _summary([[4.0, 2.0, 1.0, 1.0]], ep_size=2)
    assert (max_load, min_load, rank_load) == (2.0, 0.5, 1.5)
    # Busy and idle experts on the same rank cancel: balanced ranks, unbalanced experts.
    assert _summary([[4.0, 0.0, 2.0, 2.0]], ep_size=2)[2] == 1.0
    # The mean over MoE layers, as for the other fields.
    assert _summary([[4.0, 2.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]], ep_size=2)[2] == 1.25


def test_rank_load_is_absent_without_expert_parallelism():
    assert _summary([[4.0, 2.0, 1.0, 1.0]], ep_size=1)[2] == 0.0
    totals = {}
    moe_logging.track_moe_metrics(1.0, 1, total_loss_dict=totals, num_layers=1)
    assert "moe max load" in totals and "moe max rank load" not in totals


def test_expert_load_accumulates_in_place_for_cuda_graph_replay():
    """A whole-iteration CUDA graph replays the step's additions into the tensors it captured, without the
    Python that saves them: the per-layer tensor must stay the same object across steps and clears."""
    moe_logging.clear_aux_losses_tracker()
    moe_logging.save_expert_load(torch.tensor([2, 1, 1, 0]), 1, 1)
    stored = moe_logging.get_moe_layer_wise_logging_tracker()["_expert_load"]["counts"][1]
    moe_logging.save_expert_load(torch.tensor([2, 1, 1, 0]), 1, 1)
    moe_logging.clear_aux_losses_tracker()
    assert float(stored.sum()) == 0.0
    stored += torch.tensor([4.0, 2.0, 2.0, 0.0])  # what a replayed step writes, with no save call
    assert moe_logging._expert_load_summary(1, None, 2).tolist() == [2.0, 0.0, 1.5]
    moe_logging.save_expert_load(torch.tensor([1, 1, 1, 1]), 1, 1)
    assert moe_logging.get_moe_layer_wise_logging_tracker()["_expert_load"]["counts"][1] is stored


def test_layers_that_routed_nothing_since_the_clear_are_left_out():
    """Another model's layer slot, zeroed by the clear and not written since, does not dilute the mean."""
    moe_logging.clear_aux_losses_tracker()
    moe_logging.save_expert_load(torch.tensor([1.0, 1.0]), 1, 2)
    moe_logging.save_expert_load(torch.tensor([1.0, 1.0]), 2, 2)
    moe_logging.clear_aux_losses_tracker()
    moe_logging.save_expert_load(torch.tensor([3.0, 1.0]), 1, 2)  # layer 2 silent this step
    assert moe_logging._expert_load_summary(2, None, 1).tolist()[:2] == [1.5, 0.5]
