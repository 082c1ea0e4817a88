"""Mixture of Experts: router, token dispatchers, experts, the MoE layer and its logging utilities."""
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import BaseMoELayer, MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import Router, TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

__all__ = ["GroupedMLP", "SequentialMLP", "TEGroupedMLP", "BaseMoELayer", "MoELayer", "MoESubmodules", "Router",
           "TopKRouter", "SharedExpertMLP", "MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher"]
