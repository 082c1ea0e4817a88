"""Megatron Core's typing Protocols for the MoE layer's spec (types only: the experts, shared experts and
router here are built from ModuleSpecs). Reached from ``megatron.core.transformer.moe.moe_layer`` through
its lazy alias table; see also ``megatron/core/transformer/spec_protocols.py``.
"""
from typing import Optional, Protocol, Tuple

import torch


# Megatron's typing Protocols for the MoE spec (types only, see megatron/core/transformer/spec_protocols.py).
class ExpertsInterface(Protocol):
    """Tokens grouped by expert [N, h], tokens per local expert, each row's routing prob -> (out, bias)."""

    def forward(self, dispatched_input: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, /) -> Tuple[torch.Tensor, Optional[torch.Tensor]]: ...


class ExpertsBuilder(Protocol):
    def __call__(self, num_local_experts: int, config, /, *, pg_collection,
                 name: Optional[str] = None) -> ExpertsInterface: ...


class SharedExpertsInterface(Protocol):
    def forward(self, hidden_states: torch.Tensor, /) -> torch.Tensor: ...


class SharedExpertsBuilder(Protocol):
    def __call__(self, *, config, pg_collection, gate: bool, name: Optional[str] = None) -> SharedExpertsInterface: ...


class RouterInterface(Protocol):
    """input -> (probs, routing_map), both [tokens, experts]."""

    def forward(self, input: torch.Tensor, /) -> Tuple[torch.Tensor, torch.Tensor]: ...

    def set_layer_number(self, layer_number: int) -> None: ...


class RouterBuilder(Protocol):
    def __call__(self, /, *, config, pg_collection) -> RouterInterface: ...
