"""BERT's heads: the masked-LM transform (dense -> GeLU -> norm) and the [CLS] pooler."""
import torch

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.utils import get_device


def get_linear_layer(rows: int, columns: int, init_method, config) -> torch.nn.Linear:
    """A TP-replicated linear layer (its input is the full hidden state on every TP rank, so its grads
    agree across TP); weights drawn by ``init_method``, bias zero, both re-drawable by global name."""
    device = torch.device("cpu") if config.use_cpu_initialization else get_device()
    layer = torch.nn.Linear(rows, columns, device=device, dtype=config.params_dtype)
    layer.weight.init_fn = init_method
    layer.bias.init_fn = torch.nn.init.zeros_
    if config.perform_initialization:
        init_method(layer.weight.data)
    with torch.no_grad():
        layer.bias.zero_()
    return layer


class BertLMHead(MegatronModule):
    """h -> dense(h) -> GeLU -> LayerNorm, before the (tied) vocab projection."""

    def __init__(self, hidden_size: int, config):
        super().__init__(config)
        self.dense = get_linear_layer(hidden_size, hidden_size, config.init_method, config)
        self.layer_norm = WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=config.layernorm_epsilon)
        self.gelu = torch.nn.functional.gelu

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(self.gelu(self.dense(hidden_states)))  # [s, b, h]


class Pooler(MegatronModule):
    """tanh(dense(hidden state of token ``sequence_index``)): the sentence representation [b, h]."""

    def __init__(self, hidden_size: int, init_method, config, sequence_parallel: bool = False):
        super().__init__(config)
        if sequence_parallel:
            raise ValueError("BERT's pooler does not support --sequence-parallel; drop the flag")
        self.dense = get_linear_layer(hidden_size, hidden_size, init_method, config)

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        return torch.tanh(self.dense(hidden_states[sequence_index, :, :]))  # [b, h]
