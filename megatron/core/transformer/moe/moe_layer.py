"""MoELayer: router -> token dispatch -> local experts -> combine (+ shared experts). Replaces the MLP of a
transformer layer (chosen by the layer spec) and returns ``(output, bias=None)`` like the MLP.

Tokens are always split over the TP group inside the layer: under sequence parallelism they arrive split,
otherwise each TP rank takes its 1/tp of the sequence here and the outputs are all-gathered at the end.
So every rank of the expert grid routes distinct tokens and no expert work is duplicated across TP.
"""
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.process_groups_config import get_pg, get_pg_rank, get_pg_size
from megatron.core.tensor_parallel.layers import _make_param
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, process_group_kwargs
from megatron.core.utils import lazy_names

# Megatron's typing Protocols for the MoE spec (types only), resolved on first use.
__getattr__ = lazy_names(__name__, {name: "megatron.core._compat.moe_layer" for name in (
    "ExpertsInterface", "ExpertsBuilder", "SharedExpertsInterface", "SharedExpertsBuilder", "RouterInterface",
    "RouterBuilder")})


@dataclass
class MoESubmodules:
    experts: Union[ModuleSpec, type] = None
    shared_experts: Union[ModuleSpec, type] = None
    router: Union[ModuleSpec, type] = TopKRouter


class BaseMoELayer(MegatronModule):
    """Expert layout: EP rank m holds the global experts [m * E_local, (m + 1) * E_local).
    ``is_mtp_layer``: the MoE layer of a multi-token-prediction depth (its router logs after the decoder's
    layers). ``pg_collection``: explicit groups (tp, ep, expt_tp, tp_ep; expt_dp and tp_dp_cp where the
    router or DDP need them) for the layer and its router, dispatcher and experts; parallel_state's when
    None."""

    def __init__(self, config, layer_number: Optional[int] = None, pg_collection=None, is_mtp_layer: bool = False):
        super().__init__(config)
        self.is_mtp_layer = is_mtp_layer
        self.pg_collection = pg_collection
        ep_size = get_pg_size(pg_collection, "ep", type(self).__name__)
        ep_rank = get_pg_rank(pg_collection, "ep", type(self).__name__)
        if config.num_moe_experts % ep_size:
            raise ValueError(f"--num-experts ({config.num_moe_experts}) must be divisible by "
                             f"--expert-model-parallel-size ({ep_size})")
        self.num_local_experts = config.num_moe_experts // ep_size
        self.local_expert_indices = [ep_rank * self.num_local_experts + i for i in range(self.num_local_experts)]
        self.layer_number = layer_number
        self.router = None
        self.experts = None
        self.shared_experts = None
        self.token_dispatcher = None

    def set_layer_number(self, layer_number: int):
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)


class LatentProjection(MegatronModule):
    """--moe-latent-size's down (fc1_latent_proj) and up (fc2_latent_proj) projections: a plain linear whose weight
    every TP rank holds whole (Megatron's "duplicated" layer). Each TP rank projects its own slice of the tokens,
    so the weight's gradient is summed over TP (``sequence_parallel`` attribute, as the router's)."""

    def __init__(self, config, input_size: int, output_size: int, init_method):
        super().__init__(config)
        self.weight = _make_param((output_size, input_size), config, init_method)
        self.weight.sequence_parallel = True
        self.bias = None
        if config.add_bias_linear:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype,
                                                       device=self.weight.device))
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


class MoELayer(BaseMoELayer):
    def __init__(self, config, submodules: Optional[MoESubmodules] = None, layer_number: Optional[int] = None,
                 pg_collection=None, is_mtp_layer: bool = False, name: Optional[str] = None, **kwargs):
        super().__init__(config, layer_number, pg_collection, is_mtp_layer)
        self.name = name  # a label only (Megatron hands it to Transformer Engine)
        if submodules is None:
            submodules = MoESubmodules()
        self.router = build_module(submodules.router, config=config, pg_collection=pg_collection,
                                   is_mtp_layer=is_mtp_layer)
        self.router.set_layer_number(layer_number)
        kind = config.moe_token_dispatcher_type
        if kind == "allgather":
            dispatcher = MoEAllGatherTokenDispatcher
        elif kind == "alltoall":
            dispatcher = MoEAlltoAllTokenDispatcher
        else:
            raise ValueError(f"--moe-token-dispatcher-type {kind}: use allgather or alltoall "
                             "(flex needs DeepEP/HybridEP kernels, which this build does not have)")
        self.token_dispatcher = dispatcher(self.num_local_experts, self.local_expert_indices, config,
                                           pg_collection=pg_collection)
        self.token_dispatcher.probs_to_experts = True  # the experts scale their rows (fused in grouped SwiGLU)
        if config.moe_latent_size:
            self.fc1_latent_proj = LatentProjection(config, config.hidden_size, config.moe_latent_size,
                                                    config.init_method)
            self.fc2_latent_proj = LatentProjection(config, config.moe_latent_size, config.hidden_size,
                                                    config.output_layer_init_method)
        self.experts = build_module(submodules.experts, self.num_local_experts, config,
                                    **process_group_kwargs(submodules.experts, pg_collection, "MoELayer"))
        # --delay-wgrad-compute: the dispatcher's backward runs the experts' parked weight gradients.
        self.token_dispatcher.wgrad_store = getattr(self.experts, "wgrad_store", None)
        if config.moe_shared_expert_intermediate_size:
            spec = submodules.shared_experts
            gate = {} if "gate" in getattr(spec, "params", {}) else {"gate": config.moe_shared_expert_gate}
            self.shared_experts = build_module(spec, config=config, pg_collection=pg_collection, **gate)
        if pg_collection is None:
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
            self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        else:
            self.tp_group = get_pg(pg_collection, "tp", "MoELayer")
            self.tp_size = self.tp_group.size()
        self._side_stream = None

    def _shared_expert_start(self, hidden_states):
        """Shared expert output; with --moe-shared-expert-overlap on CUDA it runs on a side stream so it
        overlaps the dispatch collectives (joined in `_shared_expert_join`)."""
        if self.shared_experts is None:
            return None
        if not (self.config.moe_shared_expert_overlap and hidden_states.is_cuda):
            return self.shared_experts(hidden_states)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=hidden_states.device)
        self._side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side_stream):
            return self.shared_experts(hidden_states)

    def _shared_expert_join(self, shared_out):
        if shared_out is not None and self._side_stream is not None and shared_out.is_cuda:
            torch.cuda.current_stream().wait_stream(self._side_stream)
            shared_out.record_stream(torch.cuda.current_stream())
        return shared_out

    def forward(self, hidden_states: torch.Tensor):
        """hidden_states [s, b, h] (s/tp under SP) -> (output of the same shape, None)."""
        split_here = self.tp_size > 1 and not self.config.sequence_parallel
        shared_out = self._shared_expert_start(hidden_states)
        x = scatter_to_sequence_parallel_region(hidden_states, group=self.tp_group) if split_here \
            else hidden_states  # [s/tp, b, h]
        probs, routing_map = self.router(x)
        if self.config.moe_latent_size:
            x = self.fc1_latent_proj(x)
        dispatched, tokens_per_expert = self.token_dispatcher.token_permutation(x, probs, routing_map)
        expert_probs = self.token_dispatcher.expert_probs
        if self.config.moe_apply_probs_on_input and expert_probs is not None:
            # --moe-apply-probs-on-input (top-1): the expert sees p * x and its output is not scaled again.
            dispatched = dispatched * expert_probs.unsqueeze(-1).to(dispatched.dtype)
            expert_probs = None
        expert_out, mlp_bias = self.experts(dispatched, tokens_per_expert, expert_probs)
        out, _ = self.token_dispatcher.token_unpermutation(expert_out, mlp_bias)
        if self.config.moe_latent_size:
            out = self.fc2_latent_proj(out)
        if split_here:
            # Downstream grads are replicated over TP: the backward keeps this rank's slice.
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False, group=self.tp_group)
        shared_out = self._shared_expert_join(shared_out)
        if shared_out is not None:
            out = out + shared_out
        return out, None
