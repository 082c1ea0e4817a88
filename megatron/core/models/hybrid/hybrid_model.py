"""HybridModel (Megatron's name): embedding -> HybridStack (layers chosen by a pattern string) -> output
layer -> per-token loss. The forward is GPTModel's; only the decoder differs."""
import logging
from typing import Literal, Optional

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule, build_output_layer
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.hybrid.hybrid_layer_allocation import (
    Symbols,
    get_hybrid_total_layer_count,
    parse_hybrid_pattern,
    pattern_from_ratios,
    select_pipeline_segment,
)
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

logger = logging.getLogger(__name__)


def resolve_hybrid_pattern(config, hybrid_layer_pattern=None, hybrid_override_pattern=None,
                           hybrid_attention_ratio=None, hybrid_mlp_ratio=None) -> str:
    """The pattern from Megatron's spellings (``hybrid_override_pattern`` and the ratios are its deprecated
    ones), checked against ``config.num_layers``."""
    if hybrid_override_pattern is not None:
        if hybrid_layer_pattern is not None:
            raise ValueError("--hybrid-override-pattern and --hybrid-layer-pattern cannot both be set; "
                             "keep --hybrid-layer-pattern")
        hybrid_layer_pattern = hybrid_override_pattern
    if (hybrid_attention_ratio or 0.0) > 0.0 or (hybrid_mlp_ratio or 0.0) > 0.0:
        if hybrid_layer_pattern is not None:
            raise ValueError("hybrid_attention_ratio / hybrid_mlp_ratio cannot be combined with a layer pattern")
        hybrid_layer_pattern = pattern_from_ratios(config.num_layers, hybrid_attention_ratio or 0.0,
                                                   hybrid_mlp_ratio or 0.0)
    if not hybrid_layer_pattern:
        raise ValueError("a hybrid model needs --hybrid-layer-pattern (e.g. 'M*M-')")
    parsed = parse_hybrid_pattern(hybrid_layer_pattern)
    if parsed.mtp_num_depths and parsed.mtp_num_depths != (config.mtp_num_layers or 0):
        raise ValueError(f"--hybrid-layer-pattern has {parsed.mtp_num_depths} multi-token prediction depths ('/') "
                         f"but --mtp-num-layers is {config.mtp_num_layers}; make them equal (or leave "
                         "--mtp-num-layers unset)")
    if not parsed.mtp_num_depths and config.mtp_num_layers:
        raise ValueError(f"--mtp-num-layers {config.mtp_num_layers} in a hybrid model needs the MTP layers in the "
                         "pattern: '<main>/<mtp>/<mtp>...' (e.g. 'M*M-/*-/*-')")
    n = get_hybrid_total_layer_count(hybrid_layer_pattern)
    if config.num_layers and n != config.num_layers:
        raise ValueError(f"--hybrid-layer-pattern has {n} layers but --num-layers is {config.num_layers}; make "
                         "them equal (or leave --num-layers unset)")
    return hybrid_layer_pattern


class HybridModel(GPTModel):
    """A decoder-only LM whose layers follow ``hybrid_layer_pattern`` (see hybrid_layer_allocation.py).
    ``pre_process`` / ``post_process``: this stage embeds tokens / computes logits and the loss; the
    pattern's '|' markers (or an even split) give each pipeline stage its layers."""

    def __init__(self, config, hybrid_stack_spec: ModuleSpec, vocab_size: int, max_sequence_length: int,
                 hybrid_layer_pattern: Optional[str] = None, hybrid_attention_ratio: Optional[float] = None,
                 hybrid_mlp_ratio: Optional[float] = None, hybrid_override_pattern: Optional[str] = None,
                 pre_process: bool = True, post_process: bool = True, fp16_lm_cross_entropy: bool = False,
                 logit_dtype=None, parallel_output: bool = True, share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: Literal["learned_absolute", "rope", "none"] = "none",
                 rotary_percent: float = 1.0, rotary_base: int = 10000,
                 scatter_embedding_sequence_parallel: bool = True, seq_len_interpolation_factor: Optional[float] = None,
                 pg_collection=None, vp_stage: Optional[int] = None):
        LanguageModule.__init__(self, config, pg_collection)
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(f"--position-embedding-type '{position_embedding_type}' is not supported by hybrid "
                             "models; use none, rope or learned_absolute")
        if logit_dtype is not None:
            raise NotImplementedError("HybridModel(logit_dtype=...) is not supported; logits take the hidden dtype")
        self.hybrid_stack_spec = hybrid_stack_spec
        self.hybrid_layer_pattern = resolve_hybrid_pattern(config, hybrid_layer_pattern, hybrid_override_pattern,
                                                           hybrid_attention_ratio, hybrid_mlp_ratio)
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.fp16_lm_cross_entropy, self.parallel_output = fp16_lm_cross_entropy, parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.vp_stage = vp_stage
        tp_group = None if pg_collection is None else pg_collection.tp
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config, vocab_size, max_sequence_length, position_embedding_type=position_embedding_type,
                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel, tp_group=tp_group)
        self.model_rotary = position_embedding_type == "rope"
        if self.model_rotary:
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, rotary_percent, rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base,
                use_cpu_initialization=config.use_cpu_initialization)
        if Symbols.MLA in self.hybrid_layer_pattern and not getattr(config, "multi_latent_attention", False):
            raise ValueError("--hybrid-layer-pattern has multi-latent attention layers ('+'): pass "
                             "--multi-latent-attention with its sizes (--q-lora-rank, --kv-lora-rank, --qk-head-dim, "
                             "--qk-pos-emb-head-dim, --v-head-dim)")
        main = parse_hybrid_pattern(self.hybrid_layer_pattern).main_pattern or ""
        pp_rank, pp_size = self._pp_coords(pg_collection)
        layer_types, offset = select_pipeline_segment(
            main, pp_rank, pp_size, vp_stage, config.num_layers_in_first_pipeline_stage,
            config.num_layers_in_last_pipeline_stage)
        self.decoder = build_module(hybrid_stack_spec, config=config, pre_process=pre_process,
                                    layer_type_list=layer_types, pp_layer_offset=offset, post_process=post_process,
                                    pg_collection=pg_collection, vp_stage=vp_stage)
        # Multi-token prediction depths ('/' in the pattern) on the last stage, each a HybridStack of the MTP part.
        parsed = parse_hybrid_pattern(self.hybrid_layer_pattern)
        self.mtp_process = parsed.mtp_num_depths > 0 and post_process
        if self.mtp_process:
            mtp_spec = hybrid_stack_spec.submodules.mtp_block_spec
            if mtp_spec is None:
                raise ValueError("the pattern has MTP depths ('/') but the hybrid stack spec has no mtp_block_spec")
            self.mtp = MultiTokenPredictionBlock(config, mtp_spec, vp_stage=vp_stage, pg_collection=pg_collection,
                                                 mtp_layer_pattern=parsed.mtp_pattern,
                                                 mtp_num_depths=parsed.mtp_num_depths,
                                                 hybrid_submodules=hybrid_stack_spec.submodules)
        self.mtp_loss_stats = None
        if post_process:
            self.output_layer = build_output_layer(config, vocab_size, False, parallel_output, pre_process,
                                                   share_embeddings_and_output_weights, tp_group=tp_group)
        self.finalize_parameters()

    @staticmethod
    def _pp_coords(pg_collection):
        if pg_collection is not None:
            return pg_collection.pp.rank(), pg_collection.pp.size()
        return (parallel_state.get_pipeline_model_parallel_rank(),
                parallel_state.get_pipeline_model_parallel_world_size())
