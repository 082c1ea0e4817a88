"""Multi-token prediction (DeepSeek-V3): D extra prediction depths on the last stage.

Depth k (1..D) predicts token i + 1 + k at position i from the previous depth's hidden state h and the
embedding of token i + k (the inputs rolled left by k):

    h_k = final_norm(layer(eh_proj([enorm(embed(roll(ids, k))), hnorm(h_{k-1})])))

and the shared output head turns h_k into logits scored against the labels rolled left by k (the rolled-in
positions are masked out). The D losses, each a mean over its tokens, are added to the main loss with
weight ``mtp_loss_scaling_factor / D``.
"""
from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import make_viewless_tensor


def roll_tensor(tensor: torch.Tensor, shifts: int = -1, dims: int = -1):
    """Roll left along ``dims`` and zero the rolled-in slot; returns (rolled, its sum)."""
    rolled = torch.roll(tensor, shifts=shifts, dims=dims)
    rolled.select(dims, shifts).fill_(0)
    return rolled, rolled.sum()


class MTPLossAutoScaler(torch.autograd.Function):
    """Identity on the main per-token loss that also back-propagates ``mtp_loss`` (a scalar).

    The gradient given to ``mtp_loss`` is the sum of the gradients reaching the per-token loss: that is
    exactly the weight the loss function and the schedule put on one micro-batch's mean token loss
    (1/num_microbatches, times the fp16 loss scale; times the token count with --calculate-per-token-loss,
    which divides by it later), so the MTP term is weighted like the main loss without a global scale.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, mtp_loss: torch.Tensor):
        ctx.save_for_backward(mtp_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (mtp_loss,) = ctx.saved_tensors
        return grad_output, grad_output.sum().to(mtp_loss.dtype) * torch.ones_like(mtp_loss)


@dataclass
class MultiTokenPredictionLayerSubmodules:
    enorm: Union[ModuleSpec, type] = None
    hnorm: Union[ModuleSpec, type] = None
    eh_proj: Union[ModuleSpec, type] = None
    transformer_layer: Union[ModuleSpec, type] = None
    layer_norm: Union[ModuleSpec, type] = None


class MultiTokenPredictionLayer(MegatronModule):
    """One prediction depth: norms, the [embedding; hidden] -> hidden projection, a transformer layer."""

    def __init__(self, config, submodules: MultiTokenPredictionLayerSubmodules, layer_number: int = 1,
                 vp_stage: Optional[int] = None, pg_collection=None, **kwargs):
        super().__init__(config)
        self.layer_number = layer_number  # 1-based depth; names checkpoint keys mtp.layers.<depth - 1>
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.enorm = build_module(submodules.enorm, config=config, hidden_size=h, eps=eps)
        self.hnorm = build_module(submodules.hnorm, config=config, hidden_size=h, eps=eps)
        self.eh_proj = build_module(submodules.eh_proj, 2 * h, h, config=config, init_method=config.init_method,
                                    gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                                    tp_comm_buffer_name="mtp_eh_proj")
        self.transformer_layer = build_module(submodules.transformer_layer, config=config,
                                              layer_number=layer_number, vp_stage=vp_stage)
        self.final_layernorm = build_module(submodules.layer_norm, config=config, hidden_size=h, eps=eps)

    def forward(self, input_ids, position_ids, hidden_states, attention_mask, rotary_pos_emb=None,
                embedding=None, **kwargs):
        """Returns (h_k [s(/tp), b, h], the input ids and positions rolled once more)."""
        input_ids, _ = roll_tensor(input_ids)  # [b, s]
        position_ids, _ = roll_tensor(position_ids)
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)  # [s(/tp), b, h]
        x = torch.cat([self.enorm(decoder_input), self.hnorm(hidden_states)], dim=-1)  # [s(/tp), b, 2h]
        x, _ = self.eh_proj(x)  # [s, b, h/tp]
        x = gather_from_tensor_model_parallel_region(x)  # [s, b, h]
        if self.config.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x)  # [s/tp, b, h]
        rng = get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        with rng:
            x, _ = self.transformer_layer(x, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        x = self.final_layernorm(x)
        return make_viewless_tensor(x, requires_grad=True, keep_graph=True), input_ids, position_ids


@dataclass
class MultiTokenPredictionBlockSubmodules:
    layer_specs: Optional[List[ModuleSpec]] = None


class MultiTokenPredictionBlock(MegatronModule):
    """The D prediction depths; forward returns [h; h_1; ...; h_D] concatenated along the sequence dim."""

    def __init__(self, config, spec, vp_stage: Optional[int] = None, pg_collection=None, **kwargs):
        super().__init__(config)
        submodules = spec.submodules if isinstance(spec, ModuleSpec) else spec
        specs = submodules.layer_specs
        if len(specs) != config.mtp_num_layers:
            raise ValueError(f"MTP block spec has {len(specs)} layer specs; --mtp-num-layers is "
                             f"{config.mtp_num_layers}")
        self.layers = torch.nn.ModuleList(
            build_module(s, config=config, layer_number=i + 1, vp_stage=vp_stage) for i, s in enumerate(specs))

    def forward(self, input_ids, position_ids, hidden_states, attention_mask, rotary_pos_emb=None,
                embedding=None, **kwargs):
        outputs = [hidden_states]
        for layer in self.layers:
            hidden_states, input_ids, position_ids = layer(input_ids, position_ids, hidden_states, attention_mask,
                                                           rotary_pos_emb=rotary_pos_emb, embedding=embedding)
            outputs.append(hidden_states)
        return torch.cat(outputs, dim=0)


def process_mtp_loss(loss: torch.Tensor, mtp_hidden_states: List[torch.Tensor], labels: torch.Tensor,
                     loss_mask: Optional[torch.Tensor], output_layer, output_weight, compute_language_model_loss,
                     config):
    """Attach the MTP losses to the main per-token ``loss`` [b, s]; returns (loss, per-depth stats).

    Stats are [masked loss sum, token count] per depth (detached) for the ``mtp_<k> loss`` log entries.
    """
    mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
    total, stats = 0.0, []
    for hidden in mtp_hidden_states:
        logits, _ = output_layer(hidden, weight=output_weight)  # [s, b, V/tp]
        labels, _ = roll_tensor(labels)
        mask, num_tokens = roll_tensor(mask)
        token_loss = compute_language_model_loss(labels, logits) * mask  # [b, s]
        loss_sum = token_loss.sum()
        total = total + loss_sum / num_tokens.clamp(min=1)
        stats.append(torch.stack([loss_sum.detach().float(), num_tokens.detach().float()]))
    scale = config.mtp_loss_scaling_factor / len(mtp_hidden_states)
    return MTPLossAutoScaler.apply(loss, scale * total), stats


def get_mtp_layer_spec(transformer_layer_spec: ModuleSpec, norm=None, linear=None) -> ModuleSpec:
    """One MTP depth around ``transformer_layer_spec`` with local norms and a column-parallel eh_proj."""
    if norm is None:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm as norm
    if linear is None:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear as linear
    return ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=linear, transformer_layer=transformer_layer_spec, layer_norm=norm))
