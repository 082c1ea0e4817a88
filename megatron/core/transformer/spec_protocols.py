"""Megatron's typing Protocols for spec builders and the modules they build.

Types only, for static checks of specs: a spec names a class (a "builder") whose instances offer the
matching call (the "interface"). Nothing checks them at run time, here or in Megatron. Each module that
Megatron defines them in re-exports them (attention, mlp, torch_norm, transformer_layer).
"""
from typing import Optional, Protocol, Tuple

import torch

Tensor = torch.Tensor


class LinearInterface(Protocol):
    """A linear layer of a spec: x -> (output, bias or None)."""

    def forward(self, x: Tensor, /) -> Tuple[Tensor, Optional[Tensor]]: ...


class LinearLayerBuilder(Protocol):
    def __call__(self, input_size: int, output_size: int, /, *, config, init_method, bias: bool,
                 skip_bias_add: bool, **kwargs) -> LinearInterface: ...


class LinearQkvInterface(LinearInterface, Protocol):
    """The fused QKV projection of attention."""


class LinearQkvBuilder(Protocol):
    def __call__(self, input_size: int, output_size: int, /, *, config, init_method, gather_output: bool,
                 bias: bool, skip_bias_add: bool, is_expert: bool, **kwargs) -> LinearQkvInterface: ...


class LinearProjInterface(LinearInterface, Protocol):
    """The output projection of attention."""


class LinearProjBuilder(Protocol):
    def __call__(self, input_size: int, output_size: int, /, *, config, init_method, bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, is_expert: bool, **kwargs) -> LinearProjInterface: ...


class CoreAttentionInterface(Protocol):
    """(query, key, value, attention_mask, ...) -> context."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor], /,
                **kwargs) -> Tensor: ...


class CoreAttentionBuilder(Protocol):
    def __call__(self, *, config, layer_number: int, attn_mask_type, attention_type: str,
                 **kwargs) -> CoreAttentionInterface: ...


class LinearFc1Interface(LinearInterface, Protocol):
    """The first MLP projection (h -> f, or h -> 2f under GLU)."""


class LinearFc1Builder(Protocol):
    def __call__(self, input_size: int, output_size: int, /, *, config, init_method, gather_output: bool,
                 bias: bool, skip_bias_add: bool, is_expert: bool, **kwargs) -> LinearFc1Interface: ...


class LinearFc2Interface(LinearInterface, Protocol):
    """The second MLP projection (f -> h)."""


class LinearFc2Builder(Protocol):
    def __call__(self, input_size: int, output_size: int, /, *, config, init_method, bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, is_expert: bool, **kwargs) -> LinearFc2Interface: ...


class TEActivationFunctionInterface(Protocol):
    """An activation module (Transformer Engine's fused activations in Megatron)."""

    def forward(self, x: Tensor, /) -> Tensor: ...


class TEActivationFunctionBuilder(Protocol):
    def __call__(self, *, config, **kwargs) -> TEActivationFunctionInterface: ...


class LayerNormInterface(Protocol):
    def forward(self, x: Tensor, /) -> Tensor: ...


class LayerNormBuilder(Protocol):
    def __call__(self, config, hidden_size: int, eps: float = 1e-5, /) -> LayerNormInterface: ...


class MlpInterface(Protocol):
    """The MLP (dense or MoE) of a transformer layer: hidden -> (output, bias or None)."""

    def forward(self, hidden_states: Tensor, /, **kwargs) -> Tuple[Tensor, Optional[Tensor]]: ...


class MlpBuilder(Protocol):
    def __call__(self, *, config, **kwargs) -> MlpInterface: ...
