"""--cpu-offloading-num-layers N: the tensors the first N transformer layers save for their backward (inputs of
the GEMMs, norms and attention, activations) move to pinned host memory during the forward and come back in
the backward, through autograd's saved-tensor hooks. Parameters stay where they are (a layer saves its weights
for the weight-gradient GEMMs; copying them would cost transfers and save nothing). Only the tensors that go
through ``save_for_backward`` move: what a custom function keeps as a plain attribute stays on the device.

Megatron offloads the same layers with Transformer Engine's double-buffered context; here the copies are
``non_blocking`` from and to pinned buffers on the current stream, so the saving is the activations' memory of
those layers, and each costs a device-to-host copy in the forward and back in the backward."""
from typing import Set

import torch


def check_offloading(num_offloaded: int, num_layers: int, pipeline_parallel: int, recompute_granularity) -> None:
    """Megatron's limits on --cpu-offloading-num-layers (the config's and the flags' one-line errors)."""
    if not 0 < num_offloaded < num_layers:
        raise ValueError(f"--cpu-offloading-num-layers ({num_offloaded}) must be between 1 and --num-layers - 1 "
                         f"({num_layers - 1}): the last layer's backward starts at once")
    if pipeline_parallel > 1:
        raise ValueError("--cpu-offloading-num-layers with --pipeline-model-parallel-size > 1 is not supported "
                         "(as in Megatron); drop one")
    if recompute_granularity is not None:
        raise ValueError("--cpu-offloading-num-layers with activation recompute is not supported (as in Megatron): "
                         "the recomputed layers save nothing to offload; drop one")


class ActivationOffload:
    """A context that moves the saved tensors of the code inside it to the host; ``keep`` holds the storage
    pointers of tensors that stay (the layer's parameters). ``moved``: how many tensors went to the host (tests)."""

    def __init__(self, keep: Set[int]):
        self.keep, self.moved = keep, 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if t.device.type == "meta" or t.untyped_storage().data_ptr() in self.keep:
            return t
        self.moved += 1
        pin = t.is_cuda
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=pin).copy_(t, non_blocking=pin)
        return t.device, host

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=host.is_pinned())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def parameter_storages(module: torch.nn.Module) -> Set[int]:
    """The storage pointers of ``module``'s parameters: the tensors an offloading context leaves in place."""
    return {p.untyped_storage().data_ptr() for p in module.parameters()}
