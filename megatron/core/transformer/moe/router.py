"""Top-k router: a linear gate scores every expert per token and keeps k of them.

Load balancing (``moe_router_load_balancing_type``, one type or a list): ``aux_loss`` (Switch loss per
micro-batch), ``seq_aux_loss`` (per sequence), ``global_aux_loss`` (token counts over the global batch,
accumulated across micro-batches), ``sinkhorn`` (balanced assignment), ``none``; plus the z-loss and the
aux-loss-free expert bias (DeepSeek-V3), updated once per step from the step's token counts.
The router sees this rank's tokens only (MoELayer splits them over TP, context parallelism splits the
sequence over CP), so its token counts are reduced over TP x CP (TP x DP x CP for the global-batch counts
and the expert bias) and its weight gradient is summed over TP (``sequence_parallel`` attribute).
"""
from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.strategies.staging import wait_for_staged_copies
from megatron.core.process_groups_config import get_pg
from megatron.core.tensor_parallel.layers import _make_param
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_logging import save_expert_load, save_to_aux_losses_tracker
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    fused_router_fns,
    sinkhorn,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    z_loss_func,
)
from megatron.core.transformer.moe.router_gating import (
    apply_biased_logits,
    apply_random_logits,
    get_updated_expert_bias,
    router_gating_linear,
)

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _as_list(value) -> List:
    return list(value) if isinstance(value, (list, tuple)) else [value]


class Router(MegatronModule):
    """The gate: logits = x W^T with W [num_experts, hidden] (replicated on every rank).

    ``is_mtp_layer``: the router of a multi-token-prediction layer; its metrics are logged in the slots
    after the decoder's layers (layer_number + num_layers), as Megatron does. ``pg_collection``: explicit
    groups (tp; tp_dp_cp for the global-batch counts and the expert bias; tp_cp and dp_cp under context
    parallelism); parallel_state's when None."""

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        super().__init__(config)
        self.num_experts = config.num_moe_experts
        self.is_mtp_layer = is_mtp_layer
        self.layer_number = None
        self.weight = _make_param((self.num_experts, config.hidden_size), config, config.init_method)
        # Each TP rank routes a different slice of the tokens: the weight's gradient is summed over TP.
        self.weight.sequence_parallel = True
        self.pg_collection = pg_collection
        self.tp_group = (parallel_state.get_tensor_model_parallel_group() if pg_collection is None
                         else get_pg(pg_collection, "tp", type(self).__name__))
        self.tp_size = 1 if self.tp_group is None else dist.get_world_size(self.tp_group)
        # Under CP each rank routes part of every sequence: per-micro-batch counts span TP x CP.
        self.cp_size = config.context_parallel_size
        self.tp_cp_group = self.tp_group if self.cp_size == 1 else get_pg(pg_collection, "tp_cp", type(self).__name__)
        self.tp_cp_size = 1 if self.tp_cp_group is None else dist.get_world_size(self.tp_cp_group)

    def set_layer_number(self, layer_number: int):
        self.layer_number = layer_number

    def tp_dp_cp_group(self):
        """The ranks whose tokens make up the global batch, over which global-batch counts and the expert
        bias's counts are summed (tp x dp x cp, as Megatron)."""
        return get_pg(self.pg_collection, "tp_dp_cp", type(self).__name__)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype)
        if dtype is None:
            return F.linear(input, self.weight.to(input.dtype))
        return router_gating_linear(input, self.weight, None, dtype)

    def _log_slot(self):
        """(layer slot, slots) of this router's metrics: MTP layers come after the decoder's layers."""
        num_layers = self.config.num_layers
        if self.is_mtp_layer and self.layer_number is not None:
            return self.layer_number + num_layers, num_layers + (self.config.mtp_num_layers or 0)
        return self.layer_number, num_layers


class TopKRouter(Router):
    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        super().__init__(config, pg_collection, is_mtp_layer)
        self.topk = config.moe_router_topk
        self.score_function = config.moe_router_score_function
        self.routing_type = _as_list(config.moe_router_load_balancing_type)
        self.input_jitter = None
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        if self.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32,
                                                            device=self.weight.device))
            self.register_buffer("local_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32,
                                                                        device=self.weight.device),
                                 persistent=False)
        else:
            self.expert_bias = None
        if "global_aux_loss" in self.routing_type:
            self.register_buffer("global_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32,
                                                                         device=self.weight.device),
                                 persistent=False)
            self.ga_steps = 0

    def _apply(self, fn, *args, **kwargs):
        """Keep the expert bias and the token counts in fp32 when the model is cast to bf16/fp16
        (counts above 256 are not exact in bf16; the bias moves by steps of 1e-3)."""
        super()._apply(fn, *args, **kwargs)
        for name in ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert"):
            buf = self._buffers.get(name)
            if buf is not None and buf.dtype != torch.float32:
                self._buffers[name] = buf.float()
        return self

    # -- helpers ------------------------------------------------------------------------------
    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        coeffs = _as_list(self.config.moe_aux_loss_coeff)
        if len(coeffs) == 1:
            return float(coeffs[0])
        return float(coeffs[self.routing_type.index(aux_loss_type)])

    def _attach(self, probs, coeff, aux_loss, name, reduce_group, has_dp=False):
        """Log ``aux_loss / coeff`` under ``name`` and make backward add its gradient (scaled like lm loss).
        ``aux_loss`` is this rank's share: the shares sum to the loss over ``reduce_group``. Gradients are
        averaged over DP x CP, so under CP the share enters backward times CP, as the lm loss does
        (``_tokens_over_context_parallel``): the CP average is then the gradient of the whole sequence's loss."""
        save_to_aux_losses_tracker(name, aux_loss / coeff, *self._log_slot(),
                                   reduce_group=reduce_group, reduce_group_has_dp=has_dp)
        return MoEAuxLossAutoScaler.apply(probs, aux_loss * self.cp_size if self.cp_size > 1 else aux_loss)

    def _tokens_per_expert(self, routing_map, group):
        counts = routing_map.sum(dim=0).float()
        return reduce_from_tensor_model_parallel_region(counts, group) if group is not None else counts

    def apply_input_jitter(self, input: torch.Tensor) -> torch.Tensor:
        eps = self.config.moe_input_jitter_eps
        if eps is None or not self.training:
            return input
        if self.input_jitter is None:
            self.input_jitter = torch.distributions.uniform.Uniform(
                torch.tensor(1.0 - eps, device=input.device), torch.tensor(1.0 + eps, device=input.device))
        return input * self.input_jitter.rsample(input.shape).to(input.dtype)

    def apply_z_loss(self, logits):
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not (self.training and torch.is_grad_enabled()):
            return logits
        # Tokens are split over TP: each rank's mean is over its share, so the coefficient is shared too.
        z_loss = z_loss_func(logits, coeff / self.tp_size)
        logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        # Under CP each rank's mean covers its part of the sequence: the logged value averages over DP x CP.
        avg_group = get_pg(self.pg_collection, "dp_cp", type(self).__name__) if self.cp_size > 1 else None
        save_to_aux_losses_tracker("z_loss", z_loss / coeff, *self._log_slot(), reduce_group=self.tp_group,
                                   avg_group=avg_group)
        return logits

    # -- load balancing -------------------------------------------------------------------------
    def sinkhorn_load_balancing(self, logits):
        """Sinkhorn-balanced selection (training), the plain top-k at inference; weights from the router."""
        def activation(x):
            return torch.sigmoid(x) if self.topk == 1 else torch.softmax(x, dim=-1, dtype=torch.float32).type_as(x)
        if self.training:
            with torch.no_grad():
                _, indices = torch.topk(sinkhorn(logits.float()), k=self.topk, dim=1)
            logits = activation(logits)
        else:
            logits = activation(logits)
            _, indices = torch.topk(logits, k=self.topk, dim=1)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
        return logits * routing_map, routing_map

    def _apply_aux_losses(self, probs, logits, seq_length: int, bsz: int):
        scores_fn = fused_router_fns()[1] if self.config.moe_router_fusion else compute_routing_scores_for_aux_loss
        routing_map, scores = scores_fn(logits, self.topk, self.score_function)
        E, k = self.num_experts, self.topk
        if "aux_loss" in self.routing_type:
            coeff = self.get_aux_loss_coeff("aux_loss")
            counts = self._tokens_per_expert(routing_map, self.tp_cp_group)
            loss = switch_load_balancing_loss_func(scores, counts, scores.shape[0] * self.tp_cp_size, k, E, coeff)
            probs = self._attach(probs, coeff, loss, "load_balancing_loss", self.tp_cp_group)
        if "seq_aux_loss" in self.routing_type:
            coeff = self.get_aux_loss_coeff("seq_aux_loss")
            # [s, b*E]: per-sequence token counts and probabilities.
            counts = self._tokens_per_expert(routing_map.reshape(seq_length, -1), self.tp_cp_group)
            loss = switch_load_balancing_loss_func(scores.reshape(seq_length, -1), counts,
                                                   seq_length * self.tp_cp_size, k, E, coeff) / bsz
            probs = self._attach(probs, coeff, loss, "seq_load_balancing_loss", self.tp_cp_group)
        if "global_aux_loss" in self.routing_type:
            coeff = self.get_aux_loss_coeff("global_aux_loss")
            group = self.tp_dp_cp_group()
            counts = self._tokens_per_expert(routing_map, group)
            with torch.no_grad():
                self.global_tokens_per_expert += counts
            self.ga_steps += 1
            size = 1 if group is None else dist.get_world_size(group)
            loss = switch_load_balancing_loss_func(scores, self.global_tokens_per_expert / self.ga_steps,
                                                   scores.shape[0] * size, k, E, coeff)
            probs = self._attach(probs, coeff, loss, "global_load_balancing_loss", group, has_dp=True)
        return probs

    def routing(self, logits, seq_length: int = None, bsz: int = 1):
        """(probs [T, E], routing_map [T, E]) with balancing losses attached to ``probs``'s backward."""
        seq_length = logits.shape[0] if seq_length is None else seq_length
        logits = self.apply_z_loss(logits)
        if "sinkhorn" in self.routing_type:
            probs, routing_map = self.sinkhorn_load_balancing(logits)
        else:
            c = self.config
            route = fused_router_fns()[0] if c.moe_router_fusion else topk_routing_with_score_function
            probs, routing_map = route(
                logits, self.topk, use_pre_softmax=c.moe_router_pre_softmax, num_groups=c.moe_router_num_groups,
                group_topk=c.moe_router_group_topk, scaling_factor=c.moe_router_topk_scaling_factor,
                score_function=self.score_function, expert_bias=self.expert_bias)
        if self.config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, self.topk, self.config.moe_expert_capacity_factor,
                self.config.moe_token_drop_policy, self.config.moe_pad_expert_input_to_capacity)
        if self.training and torch.is_grad_enabled():
            if any(t in self.routing_type for t in ("aux_loss", "seq_aux_loss", "global_aux_loss")):
                probs = self._apply_aux_losses(probs, logits, seq_length, bsz)
            with torch.no_grad():
                counts = routing_map.sum(dim=0).float()
                if self.enable_expert_bias:
                    self.local_tokens_per_expert += counts
                save_expert_load(counts, *self._log_slot(), reduce_group=self.tp_cp_group)
        return probs, routing_map

    def forward(self, input: torch.Tensor):
        """input [s, b, h] (this rank's tokens) -> (probs, routing_map), both [s*b, E]."""
        seq_length, bsz = input.shape[0], (input.shape[1] if input.dim() == 3 else 1)
        input = self.apply_input_jitter(input)
        logits = self.gating(input).reshape(-1, self.num_experts)
        if self.config.moe_router_force_load_balancing:
            logits = apply_random_logits(logits)
        if self.config.moe_router_force_biased is not None:
            logits = apply_biased_logits(logits, self.config.moe_router_force_biased, self.layer_number)
        return self.routing(logits, seq_length, bsz)


def _routers(model_chunks):
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                yield module


@torch.no_grad()
def finalize_router_state(model_chunks, config):
    """End of a step: move expert biases toward balance (each expert's bias +rate if it got fewer tokens
    than the mean over the step, -rate if more, counts summed over all TP x DP x CP ranks) and reset the
    global-aux-loss counts. Called from finalize_model_grads on every rank."""
    routers = list(_routers(model_chunks))
    biased = [r for r in routers if r.enable_expert_bias]
    if biased:
        wait_for_staged_copies()  # the saved expert biases change below: an async save's copy goes first
        counts = torch.stack([r.local_tokens_per_expert for r in biased])
        biases = torch.stack([r.expert_bias for r in biased])
        # The routers of one model share its groups (parallel_state's, or its explicit collection's).
        updated = get_updated_expert_bias(counts, biases, config.moe_router_bias_update_rate,
                                          biased[0].tp_dp_cp_group())
        for r, bias in zip(biased, updated):
            r.expert_bias.copy_(bias)
            r.local_tokens_per_expert.zero_()
    for r in routers:
        if "global_aux_loss" in r.routing_type:
            r.global_tokens_per_expert.zero_()
            r.ga_steps = 0
