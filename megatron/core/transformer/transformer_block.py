"""The stack of transformer layers of one pipeline (virtual) stage, plus the final norm on the last.

Layer assignment: each PP rank gets an equal share (or the uneven first/last counts), split further
into ``vpp`` virtual chunks; chunks are numbered virtual-stage-major, so with PP=2, VPP=2 and 8 layers
rank 0 builds layers 0-1 and 4-5, rank 1 builds 2-3 and 6-7 (as Megatron interleaves).
"""
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import checkpoint, get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, process_group_kwargs
from megatron.core.utils import make_viewless_tensor


def layers_per_pipeline_rank(config, pp_size: int) -> List[int]:
    """Layer slots per PP rank (including the virtual embedding/loss slots when accounted for).

    ``config`` needs num_layers, num_layers_in_first/last_pipeline_stage and the two
    account_for_*_in_pipeline_split fields. Raises ValueError when the layers do not split."""
    n = config.num_layers
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        n += int(config.account_for_embedding_in_pipeline_split) + int(config.account_for_loss_in_pipeline_split)
        if n % pp_size:
            raise ValueError(f"num_layers ({config.num_layers}, {n} with embedding/loss slots) must be divisible "
                             f"by --pipeline-model-parallel-size ({pp_size}); or set "
                             "--decoder-first/last-pipeline-num-layers")
        return [n // pp_size] * pp_size
    middle_ranks = pp_size - (first is not None) - (last is not None)
    middle_layers = n - (first or 0) - (last or 0)
    if middle_ranks < 0 or middle_layers < 0:
        raise ValueError("--decoder-first/last-pipeline-num-layers exceed num_layers or the pipeline size")
    if middle_ranks == 0 and middle_layers != 0 or middle_ranks and middle_layers % middle_ranks:
        raise ValueError(f"the {middle_layers} layers left after the first/last stage counts do not split "
                         f"evenly over {middle_ranks} middle pipeline stages")
    per_middle = middle_layers // middle_ranks if middle_ranks else 0
    counts = [per_middle] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def _chunk_counts(config, pp_size: Optional[int] = None) -> List[List[int]]:
    """counts[vp][pp] = layers built by virtual chunk ``vp`` of PP rank ``pp`` (``pp_size``: parallel_state's
    pipeline size when None)."""
    pp_size = parallel_state.get_pipeline_model_parallel_world_size() if pp_size is None else pp_size
    vp_size = config.virtual_pipeline_model_parallel_size or 1
    per_rank = layers_per_pipeline_rank(config, pp_size)
    for r, c in enumerate(per_rank):
        if c % vp_size:
            raise ValueError(f"pipeline rank {r} has {c} layer slots, not divisible by "
                             f"--num-virtual-stages-per-pipeline-rank ({vp_size})")
    counts = [[c // vp_size for c in per_rank] for _ in range(vp_size)]
    if config.account_for_embedding_in_pipeline_split:
        counts[0][0] -= 1
    if config.account_for_loss_in_pipeline_split:
        counts[-1][-1] -= 1
    if min(min(row) for row in counts) < 0 or sum(map(sum, counts)) != config.num_layers:
        raise ValueError(f"pipeline layer split {counts} does not cover num_layers={config.num_layers}")
    return counts


def _vp(vp_stage: Optional[int]) -> int:
    if vp_stage is not None:
        return vp_stage
    return parallel_state.get_virtual_pipeline_model_parallel_rank() or 0


def get_num_layers_to_build(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                            pp_size: Optional[int] = None) -> int:
    """Number of transformer layers in this rank's (virtual) stage (``pp_rank`` / ``pp_size``: a pipeline
    on explicit groups; parallel_state's when None)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    return _chunk_counts(config, pp_size)[_vp(vp_stage)][pp_rank]


def get_transformer_layer_offset(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                                 pp_size: Optional[int] = None) -> int:
    """Global index of this stage's first layer: all layers of the chunks before it (virtual-stage-major)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    counts = _chunk_counts(config, pp_size)
    vp = _vp(vp_stage)
    return sum(map(sum, counts[:vp])) + sum(counts[vp][:pp_rank])


def pipeline_coords(pg_collection, owner: str) -> dict:
    """``pp_rank`` / ``pp_size`` of an explicit collection's pipeline group for the two functions above
    (no keywords without a collection: parallel_state's)."""
    if pg_collection is None:
        return {}
    pp = pg_collection.pp
    if pp is None:
        raise ValueError(f"{owner}: the explicit pg_collection has no 'pp' group, which places its layers; set "
                         "it (a one-rank group without pipelining)")
    return {"pp_rank": pp.rank(), "pp_size": pp.size()}


@dataclass
class TransformerBlockSubmodules:
    layer_specs: Optional[List[ModuleSpec]] = None  # None: no layers (Megatron's default)
    layer_norm: Optional[Union[ModuleSpec, type]] = None


def _get_block_submodules(config, spec) -> TransformerBlockSubmodules:
    if isinstance(spec, TransformerBlockSubmodules):
        return spec
    if isinstance(spec, ModuleSpec) and isinstance(spec.submodules, TransformerBlockSubmodules):
        return spec.submodules
    # A single layer spec: repeat it num_layers times.
    return TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers)


class TransformerBlock(MegatronModule):
    """``pg_collection``: explicit process groups for every layer (its ``pp`` group places the layers);
    parallel_state's groups when None."""

    def __init__(self, config, spec, post_layer_norm: bool = True, pre_process: bool = True,
                 post_process: bool = True, pg_collection=None, vp_stage: Optional[int] = None, **kwargs):
        super().__init__(config)
        self.submodules = _get_block_submodules(config, spec)
        self.pre_process, self.post_process = pre_process, post_process
        self.vp_stage = vp_stage
        self.pg_collection = pg_collection
        self.input_tensor = None
        pp = pipeline_coords(pg_collection, "TransformerBlock")
        num_layers = get_num_layers_to_build(config, vp_stage, **pp)
        offset = get_transformer_layer_offset(config, vp_stage, **pp)
        specs = self.submodules.layer_specs or []
        if len(specs) == config.num_layers:
            specs = specs[offset:offset + num_layers]
        elif len(specs) != num_layers:
            raise ValueError(f"block spec has {len(specs)} layer specs; expected {config.num_layers} or {num_layers}")
        self.layers = torch.nn.ModuleList(
            build_module(s, config=config, layer_number=i + 1, vp_stage=vp_stage,  # the layer adds `offset`
                         **process_group_kwargs(s, pg_collection, "TransformerBlock"))
            for i, s in enumerate(specs))
        self.final_layernorm = None
        if post_process and post_layer_norm:
            norm_spec = self.submodules.layer_norm
            if norm_spec is None:
                from megatron.core.transformer.torch_norm import WrappedTorchNorm
                norm_spec = WrappedTorchNorm
            self.final_layernorm = build_module(norm_spec, config=config, hidden_size=config.hidden_size,
                                                eps=config.layernorm_epsilon)

    def set_input_tensor(self, input_tensor):
        """Activation received from the previous pipeline stage; used instead of ``hidden_states``."""
        self.input_tensor = input_tensor

    def _layer_call(self, layer, hidden_states, attention_mask, rotary_pos_emb, **kwargs):
        return layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb, **kwargs)[0]

    def _recompute_layer(self, index: int) -> bool:
        c = self.config
        # 'block': checkpoint each of the first recompute_num_layers layers of this stage
        # ('uniform' is handled in _forward_layers, one checkpoint per group of N layers).
        if c.recompute_granularity != "full" or not self.training or c.recompute_method != "block":
            return False
        return index < c.recompute_num_layers

    def _forward_layers(self, hidden_states, attention_mask, rotary_pos_emb, **kwargs):
        c = self.config
        if c.recompute_granularity == "full" and self.training and c.recompute_method == "uniform":
            n = c.recompute_num_layers
            for start in range(0, len(self.layers), n):
                chunk = self.layers[start:start + n]

                def run(h, m, r, chunk=chunk):
                    for layer in chunk:
                        h = self._layer_call(layer, h, m, r, **kwargs)
                    return h
                hidden_states = checkpoint(run, False, hidden_states, attention_mask, rotary_pos_emb)
            return hidden_states
        for i, layer in enumerate(self.layers):
            if self._recompute_layer(i):
                hidden_states = checkpoint(
                    lambda h, m, r, layer=layer: self._layer_call(layer, h, m, r, **kwargs), False,
                    hidden_states, attention_mask, rotary_pos_emb)
            else:
                hidden_states = self._layer_call(layer, hidden_states, attention_mask, rotary_pos_emb, **kwargs)
        return hidden_states

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, **kwargs):
        if not self.pre_process:
            hidden_states = self.input_tensor  # [s, b, h] from the previous stage
        hidden_states = make_viewless_tensor(hidden_states, requires_grad=True, keep_graph=True)
        attention_mask = _simplify_causal_mask(attention_mask)
        # Under SP the activations are split over TP, so dropout must differ per rank.
        rng = get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        # Decoder blocks of encoder-decoder models also take the encoder output and its mask.
        cross = {} if context is None else {"context": context, "context_mask": context_mask}
        if packed_seq_params is not None:
            cross["packed_seq_params"] = packed_seq_params
        if inference_context is not None:  # generation: each attention reads/writes its KV cache
            cross["inference_context"] = inference_context
        with rng:
            hidden_states = self._forward_layers(hidden_states, attention_mask, rotary_pos_emb, **cross)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            hidden_states = make_viewless_tensor(hidden_states, requires_grad=True, keep_graph=True)
        return hidden_states


def _simplify_causal_mask(mask):
    """None when ``mask`` is the plain causal mask for every sample (True = masked above the diagonal),
    so attention can take SDPA's is_causal fast path; otherwise the mask unchanged."""
    if mask is None:
        return None
    sq, sk = mask.shape[-2], mask.shape[-1]
    causal = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=mask.device), diagonal=1)
    return None if bool((mask == causal).all()) else mask

