"""Batch plumbing of megatron.core.utils: broadcast a micro-batch over the TP group, and flatten a packed
(THD) micro-batch of several samples into one token stream."""
from typing import Any, Dict

import torch

from megatron.core.utils import get_device

__all__ = ["get_batch_on_this_tp_rank", "flatten_batch_for_packed_sequences"]
_SEQ_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _stage_keys(pipeline_model_parallel_size, mtp_on_this_rank, is_pipeline_first_stage, is_pipeline_last_stage):
    """Which [b, s] tensors this stage needs: all without PP (or with MTP), inputs on the first stage,
    targets on the last, none in between."""
    if pipeline_model_parallel_size == 1 or mtp_on_this_rank:
        return _SEQ_KEYS
    if is_pipeline_first_stage:
        return ("tokens", "position_ids")
    if is_pipeline_last_stage:
        return ("labels", "loss_mask")
    return ()


def get_batch_on_this_tp_rank(batch, has_cu_seqlens, is_hybrid_cp, create_attention_mask_in_dataloader,
                              broadcast_src_rank, broadcast_group, cp_size, tp_rank, micro_batch_size, seq_length,
                              mtp_on_this_rank, pipeline_model_parallel_size=1, is_pipeline_first_stage=False,
                              is_pipeline_last_stage=False):
    """TP rank 0's batch on every rank of `broadcast_group` (its global rank is `broadcast_src_rank`).

    Rank 0 passes its batch dict ([b, s] int64 tokens/labels/position_ids, float loss_mask, optional bool
    [b, 1, s, s] attention_mask, int32 [b, n] cu_seqlens / cu_seqlens_padded and [b] max_seqlen when
    `has_cu_seqlens`); the others pass anything and get freshly received tensors. Keys a pipeline stage
    does not need come back as None, as in Megatron."""
    if is_hybrid_cp:
        raise NotImplementedError("get_batch_on_this_tp_rank(is_hybrid_cp=True): hybrid context parallelism is "
                                  "not implemented")
    keys = _stage_keys(pipeline_model_parallel_size, mtp_on_this_rank, is_pipeline_first_stage,
                       is_pipeline_last_stage)
    has_mask = create_attention_mask_in_dataloader and bool(keys)
    device = next((t.device for t in (batch or {}).values() if torch.is_tensor(t)), None) or get_device()

    def bcast(t):
        torch.distributed.broadcast(t, broadcast_src_rank, group=broadcast_group)
        return t

    def bcast_cu_seqlens(t):  # length first: receivers cannot know how many offsets a sample has
        n = bcast(torch.tensor(0 if t is None else t.numel(), dtype=torch.int64, device=device)).item()
        if n == 0:
            return None
        if t is None:
            t = torch.empty((micro_batch_size, n // micro_batch_size), dtype=torch.int32, device=device)
        return bcast(t)

    out = {k: None for k in _SEQ_KEYS + ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen",
                                         "local_cp_size", "hybrid_cp_group")}
    src = tp_rank == 0
    shape = (micro_batch_size, seq_length)
    dtypes = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32, "position_ids": torch.int64}
    for k in keys:
        out[k] = bcast(batch[k].contiguous() if src else torch.empty(shape, dtype=dtypes[k], device=device))
    if has_cu_seqlens:
        out["cu_seqlens"] = bcast_cu_seqlens(batch["cu_seqlens"] if src else None)
        out["max_seqlen"] = bcast(batch["max_seqlen"] if src else
                                  torch.empty(micro_batch_size, dtype=torch.int32, device=device))
        if cp_size > 1:
            out["cu_seqlens_padded"] = bcast_cu_seqlens(batch["cu_seqlens_padded"] if src else None)
    if has_mask:
        out["attention_mask"] = bcast(batch["attention_mask"] if src else torch.empty(
            (micro_batch_size, 1, seq_length, seq_length), dtype=torch.bool, device=device))
    if src:  # rank 0 keeps its own dict, with the unneeded keys dropped
        batch = dict(batch)
        batch.update({k: None for k in _SEQ_KEYS if k not in keys})
        return batch
    return out


def _merge_cu_seqlens(cu_seqlens, seq_length):
    """[b, n] per-sample offsets (each row 0 .. seq_length, right-padded with seq_length) -> one 1-D
    offset list over the b * seq_length concatenated tokens."""
    parts = []
    for i, row in enumerate(cu_seqlens):
        hits = (row == seq_length).nonzero(as_tuple=True)[0]
        row = row[:hits[0].item() + 1] if hits.numel() else row
        parts.append(row if i == 0 else row[1:] + i * seq_length)
    return torch.cat(parts)


def flatten_batch_for_packed_sequences(batch: Dict[str, Any]) -> Dict[str, Any]:
    """A packed micro-batch of b samples as one sample of b * s tokens, the layout THD attention takes:
    [b, s] tensors -> [1, b*s], cu_seqlens (and cu_seqlens_padded) merged into [1, n], max_seqlen -> its max.
    A batch without cu_seqlens is returned unchanged."""
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is None:
        return batch
    present = [batch[k] for k in _SEQ_KEYS if batch.get(k) is not None]
    seq_length = present[0].shape[1] if present else int(cu_seqlens[0, -1])
    batch["cu_seqlens"] = _merge_cu_seqlens(cu_seqlens, seq_length).unsqueeze(0)
    if batch.get("cu_seqlens_padded") is not None:
        batch["cu_seqlens_padded"] = _merge_cu_seqlens(batch["cu_seqlens_padded"], seq_length).unsqueeze(0)
    if batch.get("max_seqlen") is not None:
        batch["max_seqlen"] = batch["max_seqlen"].max().unsqueeze(0)
    for k in _SEQ_KEYS:
        if batch.get(k) is not None:
            batch[k] = batch[k].reshape(1, -1)
    return batch
