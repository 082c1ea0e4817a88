"""Under `--use-torch-fsdp2` a param is a DTensor: this rank's local TP shard, split again on dim 0
over the DP group. Checkpoints and the optimizer speak in whole local-TP tensors, exactly as under
DDP, so a checkpoint saved with FSDP2 loads without it (and under another TP/PP/DP) and vice versa.

`full_local_tensor` gathers a DTensor over DP (a collective: every DP rank must call it, in the same
order); `shard_like` is its inverse and needs no communication.
"""
import torch


def is_dtensor(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (shares its storage), or ``t`` itself."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def megatron_attributes(param) -> dict:
    """The partition metadata and flags Megatron sets on a param (`tensor_model_parallel`, ...)."""
    return {k: v for k, v in vars(param).items() if not k.startswith("_")}


@torch.no_grad()
def full_local_tensor(t: torch.Tensor, source=None) -> torch.Tensor:
    """The whole local-TP tensor of DTensor ``t`` (plain tensor, no grad) carrying the Megatron
    attributes of ``source`` (default ``t``); ``t`` itself when it is not a DTensor.

    The source param records the result's storage (data pointer, numel) so that the optimizer can
    find which ShardedTensor of the model's sharded_state_dict (a view of it) describes it.
    """
    if not is_dtensor(t):
        return t
    source = t if source is None else source
    full = t.full_tensor().detach()
    for key, value in megatron_attributes(source).items():
        setattr(full, key, value)
    source._fsdp2_gathered_storage = (full.data_ptr(), full.numel())
    return full


def fsdp2_gathered_storage(param):
    """(data pointer, numel) of the last `full_local_tensor` gathered for ``param``, else None.
    Every sharded_state_dict regathers all params, so the key describes the current dict."""
    return getattr(param, "_fsdp2_gathered_storage", None)


@torch.no_grad()
def shard_like(value: torch.Tensor, target) -> torch.Tensor:
    """``value`` (a whole local-TP tensor) laid out like DTensor ``target``: only the local chunk is
    kept (no communication); ``value`` itself when ``target`` is not a DTensor."""
    if not is_dtensor(target) or is_dtensor(value) or not torch.is_tensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor  # lazy: ~0.8 s to import, only for FSDP2 DTensors

    if value.shape != target.shape and value.numel() == target.numel():
        value = value.reshape(target.shape)  # a reshaped checkpoint view (SwiGLU fc1 as [2, f, h])
    value = value.to(device=target.device)
    return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
