"""Megatron Core's ``multi_token_prediction`` names that this project's own code does not call.

``get_mtp_layer_spec``: one MTP depth with the local modules (the specs here call
``get_mtp_layer_spec_for_backend``). ``get_mtp_ranks`` / ``get_mtp_layer_offset``: all MTP layers sit on
the last pipeline stage, so the answers are fixed. ``tie_*_state_dict``: mark the MTP stage's copy of a
tied weight as a replica in a sharded state dict. ``MTPLossLoggingHelper``: per-depth multi-token-prediction metrics
accumulated over an iteration's micro-batches and logged once, for training loops built on Megatron Core.
This application's own loop reports each depth's loss through the loss function's dict
(``mtp_<k> loss``, token-weighted like ``lm loss``); code that calls ``save_metrics_to_tracker`` from its
own MTP loss computation and ``track_mtp_metrics`` from its logging gets Megatron's metrics: the loss
per depth, averaged over ``avg_group`` and scaled by ``loss_scale`` (1 / micro-batches), and the
acceptance rate (top-1 predictions equal to the label, in %) of the step and since the process started.
"""
from typing import List, Optional

import torch

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.multi_token_prediction import _require_parsed_layout, get_mtp_layer_spec_for_backend
from megatron.core.transformer.sharded_state import make_tp_sharded_tensor_for_checkpoint
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_rank


def _all_reduce(values: torch.Tensor, group, average: bool) -> None:
    """Sum (or mean) over ``group``; the mean is a sum divided by the group size, as gloo has no AVG."""
    torch.distributed.all_reduce(values, group=group)
    if average:
        values /= torch.distributed.get_world_size(group)


class MTPLossLoggingHelper:
    """Class-level tracker: ``tracker`` holds ``loss_values``, ``correct_values`` and ``total_values``
    (one entry per MTP depth) and the groups to reduce them over."""

    tracker = {}

    @staticmethod
    def save_metrics_to_tracker(loss: torch.Tensor, correct: torch.Tensor, total: torch.Tensor,
                                layer_number: int, num_layers: int, reduce_group=None, avg_group=None):
        """Add one micro-batch's ``loss`` (already normalized per token) and acceptance counts of depth
        ``layer_number`` (0-based; None: not logged). Losses are summed over ``reduce_group`` and
        averaged over ``avg_group`` when reduced; counts are summed over both."""
        if layer_number is None:
            return
        tracker = MTPLossLoggingHelper.tracker
        for key in ("loss_values", "correct_values", "total_values"):
            if key not in tracker:
                tracker[key] = torch.zeros(num_layers, device=loss.device)
        tracker["loss_values"][layer_number] += loss.detach()
        tracker["correct_values"][layer_number] += correct.detach()
        tracker["total_values"][layer_number] += total.detach()
        tracker["reduce_group"], tracker["avg_group"] = reduce_group, avg_group

    @staticmethod
    def clean_metrics_in_tracker():
        """Zero the accumulated values (the cumulative acceptance counts are kept)."""
        tracker = MTPLossLoggingHelper.tracker
        for key in ("loss_values", "correct_values", "total_values"):
            if key in tracker:
                tracker[key].zero_()
        tracker["reduce_group"] = tracker["avg_group"] = None

    @staticmethod
    def reduce_metrics_in_tracker():
        """All-reduce the accumulated values over the saved groups (collective over them)."""
        tracker = MTPLossLoggingHelper.tracker
        if "loss_values" not in tracker:
            return
        reduce_group, avg_group = tracker.get("reduce_group"), tracker.get("avg_group")
        for key, average in (("loss_values", True), ("correct_values", False), ("total_values", False)):
            if key not in tracker:
                continue
            if reduce_group is not None:
                _all_reduce(tracker[key], reduce_group, average=False)
            if avg_group is not None:
                _all_reduce(tracker[key], avg_group, average=average)

    @staticmethod
    def track_mtp_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None):
        """Reduce, then add ``mtp_<k> loss`` (times ``loss_scale``) to ``total_loss_dict`` and write it
        with ``mtp_<k>_acceptance_rate`` and ``mtp_<k>_cumulative_acceptance_rate`` to the TensorBoard
        ``writer`` / ``wandb_writer``; then clean the tracker for the next iteration."""
        MTPLossLoggingHelper.reduce_metrics_in_tracker()
        tracker = MTPLossLoggingHelper.tracker
        if "loss_values" not in tracker:
            return
        losses = tracker["loss_values"] * loss_scale
        corrects = tracker.get("correct_values", torch.zeros_like(losses))
        totals = tracker.get("total_values", torch.ones_like(losses))
        # Process-local: cumulative rates start again after a restart.
        for key, step in (("cumulative_correct_values", corrects), ("cumulative_total_values", totals)):
            if key not in tracker or tracker[key].shape != step.shape:
                tracker[key] = torch.zeros_like(step)
            tracker[key] += step
        cum_corrects, cum_totals = tracker["cumulative_correct_values"], tracker["cumulative_total_values"]
        for i in range(losses.shape[0]):
            loss_name = f"mtp_{i + 1} loss"
            names = (f"mtp_{i + 1}_acceptance_rate", f"mtp_{i + 1}_cumulative_acceptance_rate")
            loss = losses[i]
            # An empty mask leaves no valid position: clamp the denominators to avoid NaN.
            rates = (corrects[i] / totals[i].clamp(min=1) * 100.0,
                     cum_corrects[i] / cum_totals[i].clamp(min=1) * 100.0)
            if total_loss_dict is not None:
                total_loss_dict[loss_name] = total_loss_dict.get(loss_name, torch.zeros_like(loss)) + loss
            if writer is not None:
                writer.add_scalar(loss_name, loss, iteration)
                for name, rate in zip(names, rates):
                    writer.add_scalar(name, rate, iteration)
            if wandb_writer is not None:
                wandb_writer.log({loss_name: loss}, iteration)
                for name, rate in zip(names, rates):
                    wandb_writer.log({name: rate}, iteration)
        MTPLossLoggingHelper.clean_metrics_in_tracker()


def get_mtp_layer_spec(mtp_model_layer_spec: ModuleSpec, use_transformer_engine: bool = True) -> ModuleSpec:
    """One MTP depth around ``mtp_model_layer_spec``; ``use_transformer_engine`` picks the same (local)
    modules, our fastest: no Transformer Engine here."""
    return get_mtp_layer_spec_for_backend(mtp_model_layer_spec, LocalSpecProvider())


def get_mtp_ranks(pp_ranks: List[int], config) -> List[int]:
    """The ranks of ``pp_ranks`` (one pipeline) that hold MTP layers: the last one, or none."""
    _require_parsed_layout(config.pipeline_model_parallel_layout)
    return [] if config.mtp_num_layers is None else [pp_ranks[-1]]


def get_mtp_layer_offset(config, vp_stage: Optional[int] = None) -> int:
    """Index of this stage's first MTP layer: all of them sit on one stage, so 0."""
    _require_parsed_layout(config.pipeline_model_parallel_layout)
    return 0


def _tie_replica(sharded_state_dict, weight, key, tp_group, dp_cp_group):
    """Replace ``key`` by a TP-sharded tensor marked as a second copy (replica_id (1, 0, dp rank)): the
    checkpoint keeps the embedding / output-layer copy of the stage that owns it."""
    if key not in sharded_state_dict:
        raise KeyError(f"{key} is not in the sharded state dict")
    sharded_state_dict[key] = make_tp_sharded_tensor_for_checkpoint(
        tensor=weight, key=key, replica_id=(1, 0, get_pg_rank(dp_cp_group)), allow_shape_mismatch=True,
        tp_group=tp_group, dp_cp_group=dp_cp_group)


def tie_word_embeddings_state_dict(sharded_state_dict, word_emb_weight, word_emb_weight_key: str, tp_group,
                                   dp_cp_group) -> None:
    """In place: the MTP stage's word-embedding entry becomes a replica of the first stage's."""
    _tie_replica(sharded_state_dict, word_emb_weight, word_emb_weight_key, tp_group, dp_cp_group)


def tie_output_layer_state_dict(sharded_state_dict, output_layer_weight, output_layer_weight_key: str, tp_group,
                                dp_cp_group) -> None:
    """In place: the MTP stage's output-layer entry becomes a replica of the last stage's."""
    _tie_replica(sharded_state_dict, output_layer_weight, output_layer_weight_key, tp_group, dp_cp_group)
