"""Megatron Core's typing Protocols for Transformer Engine's grouped expert linears (types only: the
experts here are built by ``GroupedMLP`` whatever the spec names). Reached from
``megatron.core.transformer.moe.experts`` through its lazy alias table; see also
``megatron/core/transformer/spec_protocols.py``.
"""
from typing import Callable, List, Optional, Protocol, Tuple

import torch


class GroupedLinearFc1Interface(Protocol):
    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: List[int], /
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]: ...


class GroupedLinearFc1Builder(Protocol):
    def __call__(self, num_local_experts: int, input_size: int, output_size: int, /, *, config,
                 init_method: Callable[[torch.Tensor], None], bias: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: Optional[str], pg_collection, name: Optional[str] = None
                 ) -> GroupedLinearFc1Interface: ...


class GroupedLinearFc2Interface(Protocol):
    def forward(self, intermediate_parallel: torch.Tensor, tokens_per_expert: List[int], /
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]: ...


class GroupedLinearFc2Builder(Protocol):
    def __call__(self, num_local_experts: int, input_size: int, output_size: int, /, *, config,
                 init_method: Callable[[torch.Tensor], None], bias: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: Optional[str], pg_collection, name: Optional[str] = None
                 ) -> GroupedLinearFc2Interface: ...
