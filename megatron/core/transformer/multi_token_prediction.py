"""Multi-token prediction (DeepSeek-V3): D extra prediction depths on the last stage.

Depth k (1..D) predicts token i + 1 + k at position i from the previous depth's hidden state h and the
embedding of token i + k (the inputs rolled left by k):

    h_k = final_norm(layer(eh_proj([enorm(embed(roll(ids, k))), hnorm(h_{k-1})])))

and the shared output head turns h_k into logits scored against the labels rolled left by k (the rolled-in
positions are masked out). The D losses, each a mean over its tokens, are added to the main loss with
weight ``mtp_loss_scaling_factor / D``.

In a hybrid model (``--hybrid-layer-pattern "<main>/<mtp>/<mtp>..."``) each depth's layer is a HybridStack of
the MTP pattern's layers (Mamba-2, attention, MLP, ...), built as Megatron does from ``mtp_layer_pattern`` and
the stack's ``hybrid_submodules`` and kept under Megatron's name ``mtp_model_layer``
(keys mtp.layers.<d>.mtp_model_layer.layers.<i>.*).
"""
from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, process_group_kwargs
from megatron.core.utils import lazy_names, make_viewless_tensor

# Megatron's MTP names that this project's own loop, specs and checkpoints do not call (the metrics
# tracker, the Transformer-Engine-flavoured spec getter, fixed-answer rank / offset getters, the
# tied-weight replica helpers), resolved on first use.
__getattr__ = lazy_names(__name__, {name: "megatron.core._compat.multi_token_prediction" for name in (
    "MTPLossLoggingHelper", "get_mtp_layer_spec", "get_mtp_ranks", "get_mtp_layer_offset",
    "tie_word_embeddings_state_dict", "tie_output_layer_state_dict")})


def roll_tensor(tensor: torch.Tensor, shifts: int = -1, dims: int = -1, cp_group=None, packed_seq_params=None):
    """Roll left along ``dims`` and zero the rolled-in slot; returns (rolled, its sum), (None, None) for None.
    With ``packed_seq_params`` each packed sequence (cu_seqlens_q) rolls within its own bounds. A context
    parallel group of size > 1 is refused: MTP runs without context parallelism here."""
    if tensor is None:
        return None, None
    if cp_group is not None and cp_group.size() > 1:
        raise NotImplementedError("roll_tensor across context-parallel ranks is not supported (MTP with "
                                  "--context-parallel-size > 1)")
    if packed_seq_params is not None:
        if shifts != -1 or dims not in (-1, tensor.dim() - 1):
            raise ValueError("packed-sequence roll_tensor supports shifts=-1 along the last dim only")
        rolled = tensor.clone()
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            seq = torch.roll(tensor[..., start:end], shifts=-1, dims=-1)
            seq[..., -1:] = 0
            rolled[..., start:end] = seq
        return rolled, rolled.sum()
    rolled = torch.roll(tensor, shifts=shifts, dims=dims)
    rolled.select(dims, shifts).fill_(0)
    return rolled, rolled.sum()


# ---- placement: MTP sits on the last stage (a --pipeline-model-parallel-layout may only put it there) ----
def _require_parsed_layout(layout):
    """MTP layers are built on the last pipeline stage; a layout is accepted when it puts them there (checked
    when the config is made: PipelineParallelLayerLayout.validate_layer_layout)."""
    if isinstance(layout, (str, list)):
        raise ValueError("pass the TransformerConfig's parsed pipeline_model_parallel_layout, not the raw layout")


def mtp_on_this_rank(layout=None, mtp_num_layers: Optional[int] = None, ignore_virtual: Optional[bool] = True,
                     vp_stage: Optional[int] = None) -> bool:
    """Whether this rank builds MTP layers: the last pipeline stage (last virtual stage unless
    ``ignore_virtual``) when ``mtp_num_layers`` is set."""
    _require_parsed_layout(layout)
    return mtp_num_layers is not None and parallel_state.is_pipeline_last_stage(
        ignore_virtual=ignore_virtual, vp_stage=vp_stage)


def get_mtp_num_layers_to_build(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> int:
    """config.mtp_num_layers on the last (virtual) pipeline stage, else 0 (``pp_rank`` is not consulted,
    as in Megatron without a custom layout)."""
    _require_parsed_layout(config.pipeline_model_parallel_layout)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage):
        return config.mtp_num_layers or 0
    return 0


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
    """``mtp_model_layer`` is Megatron 0.19's name for the depth's transformer layer spec;
    ``transformer_layer`` (its earlier name) is accepted too. The built module is ``transformer_layer``
    (checkpoint keys mtp.layers.<d>.transformer_layer.*)."""
    enorm: Union[ModuleSpec, type] = None
    hnorm: Union[ModuleSpec, type] = None
    eh_proj: Union[ModuleSpec, type] = None
    transformer_layer: Union[ModuleSpec, type] = None
    layer_norm: Union[ModuleSpec, type] = None
    mtp_model_layer: Union[ModuleSpec, type] = None


def _hybrid_parts(mtp_layer_pattern, hybrid_submodules, mamba_submodules):
    """(pattern, submodules) of a hybrid depth, or (None, None) for a transformer-layer depth.
    ``mamba_submodules`` is Megatron's older name for ``hybrid_submodules``."""
    submodules = hybrid_submodules if hybrid_submodules is not None else mamba_submodules
    if (mtp_layer_pattern is None) != (submodules is None):
        raise ValueError("a hybrid MTP depth needs both mtp_layer_pattern and hybrid_submodules")
    if mtp_layer_pattern is not None:
        if not mtp_layer_pattern or "|" in mtp_layer_pattern or "/" in mtp_layer_pattern:
            raise ValueError(f"MTP layer pattern '{mtp_layer_pattern}': one depth's layer symbols, without "
                             "'|' or '/'")
    return mtp_layer_pattern, submodules


class MultiTokenPredictionLayer(MegatronModule):
    """One prediction depth: norms, the [embedding; hidden] -> hidden projection, a transformer layer."""

    def __init__(self, config, submodules: MultiTokenPredictionLayerSubmodules, layer_number: int = 1,
                 vp_stage: Optional[int] = None, pg_collection=None, mtp_layer_pattern: Optional[str] = None,
                 hybrid_submodules=None, mamba_submodules=None, name: Optional[str] = None, **kwargs):
        super().__init__(config)
        self.mtp_layer_pattern, hybrid = _hybrid_parts(mtp_layer_pattern, hybrid_submodules, mamba_submodules)
        self.name = name
        self.layer_number = layer_number  # 1-based depth; names checkpoint keys mtp.layers.<depth - 1>
        # Explicit groups: eh_proj and the gathers use its TP group, the layer gets the collection
        # (None: parallel_state's, the default build unchanged).
        self._tp_group = None if pg_collection is None else pg_collection.tp
        tp_kwargs = {} if pg_collection is None else {"tp_group": pg_collection.tp}
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.enorm = build_module(submodules.enorm, config=config, hidden_size=h, eps=eps)
        self.hnorm = build_module(submodules.hnorm, config=config, hidden_size=h, eps=eps)
        self.eh_proj = build_module(submodules.eh_proj, 2 * h, h, config=config, init_method=config.init_method,
                                    gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                                    tp_comm_buffer_name="mtp_eh_proj", **tp_kwargs)
        if hybrid is not None:
            # The depth's own stack, numbered 1..len(pattern); the depth's final_layernorm below ends it.
            self.mtp_model_layer = HybridStack(
                config, hybrid, pre_process=True, layer_type_list=list(self.mtp_layer_pattern), pp_layer_offset=0,
                post_layer_norm=False, post_process=True, pg_collection=pg_collection, is_mtp_layer=True,
                vp_stage=vp_stage)
        else:
            layer_spec = submodules.mtp_model_layer if submodules.mtp_model_layer is not None \
                else submodules.transformer_layer
            # Numbered by depth (1..D), without the stage offset; its metrics keep the decoder's slots 1..D.
            self.transformer_layer = build_module(
                layer_spec, config=config, layer_number=layer_number, vp_stage=vp_stage, add_layer_offset=False,
                **process_group_kwargs(layer_spec, pg_collection, type(self).__name__))
        self.final_layernorm = build_module(submodules.layer_norm, config=config, hidden_size=h, eps=eps)

    def forward(self, input_ids, position_ids, hidden_states, attention_mask, rotary_pos_emb=None,
                embedding=None, **kwargs):
        """Returns (h_k [s(/tp), b, h], the input ids and positions rolled once more)."""
        input_ids, _ = roll_tensor(input_ids)  # [b, s]
        position_ids, _ = roll_tensor(position_ids)
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)  # [s(/tp), b, h]
        x = torch.cat([self.enorm(decoder_input), self.hnorm(hidden_states)], dim=-1)  # [s(/tp), b, 2h]
        x, _ = self.eh_proj(x)  # [s, b, h/tp]
        x = gather_from_tensor_model_parallel_region(x, group=self._tp_group)  # [s, b, h]
        if self.config.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, group=self._tp_group)  # [s/tp, b, h]
        if self.mtp_layer_pattern is not None:  # the stack forks the RNG itself under sequence parallelism
            x = self.mtp_model_layer(x, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        else:
            rng = get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
            with rng:
                x, _ = self.transformer_layer(x, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        x = self.final_layernorm(x)
        return make_viewless_tensor(x, requires_grad=True, keep_graph=True), input_ids, position_ids


@dataclass
class MultiTokenPredictionBlockSubmodules:
    layer_specs: Optional[List[ModuleSpec]] = None


class MultiTokenPredictionBlock(MegatronModule):
    """The D prediction depths; forward returns [h; h_1; ...; h_D] concatenated along the sequence dim. With
    ``config.mtp_use_repeated_layer`` one layer (checkpoint keys mtp.layers.0.*) computes every depth."""

    def __init__(self, config, spec, vp_stage: Optional[int] = None, pg_collection=None,
                 mtp_layer_pattern: Optional[str] = None, mtp_num_depths: int = 0, hybrid_submodules=None,
                 mamba_submodules=None, name: Optional[str] = None, **kwargs):
        """``mtp_num_depths`` > 0 (a hybrid pattern's '/' count) must equal config.mtp_num_layers; the hybrid
        path builds that many depths from the spec's layer specs (the last one repeated, as Megatron does),
        each a HybridStack of ``mtp_layer_pattern``."""
        super().__init__(config)
        self.mtp_layer_pattern, hybrid = _hybrid_parts(mtp_layer_pattern, hybrid_submodules, mamba_submodules)
        self.mtp_num_depths = mtp_num_depths
        self.name = name
        submodules = spec.submodules if isinstance(spec, ModuleSpec) else spec
        specs = submodules.layer_specs
        if mtp_num_depths not in (0, config.mtp_num_layers):
            raise ValueError(f"the MTP pattern has {mtp_num_depths} depths but --mtp-num-layers is "
                             f"{config.mtp_num_layers}")
        if hybrid is not None:
            specs = [specs[min(i, len(specs) - 1)] for i in range(config.mtp_num_layers)]
            extra = dict(mtp_layer_pattern=self.mtp_layer_pattern, hybrid_submodules=hybrid)
        elif len(specs) != config.mtp_num_layers:
            raise ValueError(f"MTP block spec has {len(specs)} layer specs; --mtp-num-layers is "
                             f"{config.mtp_num_layers}")
        else:
            extra = {}
        self.mtp_use_repeated_layer = bool(getattr(config, "mtp_use_repeated_layer", False))
        if self.mtp_use_repeated_layer:  # one layer, applied at every depth (Megatron builds the first spec)
            specs = specs[:1]
        self.layers = torch.nn.ModuleList(
            build_module(s, config=config, layer_number=i + 1, vp_stage=vp_stage, **extra,
                         **process_group_kwargs(s, pg_collection, type(self).__name__)) for i, s in enumerate(specs))

    def forward(self, input_ids, position_ids, hidden_states, attention_mask, rotary_pos_emb=None,
                embedding=None, **kwargs):
        outputs = [hidden_states]
        depths = [self.layers[0]] * self.config.mtp_num_layers if self.mtp_use_repeated_layer else self.layers
        for layer in depths:
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


def get_mtp_layer_spec_for_backend(mtp_model_layer_spec: ModuleSpec, backend) -> ModuleSpec:
    """One MTP depth with ``backend``'s norm and column-parallel eh_proj."""
    norm = backend.layer_norm()
    return ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=backend.column_parallel_linear(), mtp_model_layer=mtp_model_layer_spec,
        layer_norm=norm))
