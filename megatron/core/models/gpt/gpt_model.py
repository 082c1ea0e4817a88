"""GPTModel: embedding -> transformer block -> output layer -> per-token loss, one pipeline stage at a time."""
import functools
from typing import Literal, Optional

import torch

from megatron.core.context_parallel.utils import local_rotary_pos_emb
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding, RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule, build_output_layer
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock, process_mtp_loss
from megatron.core.transformer.mup import scale_logits
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.window_attention import is_layer_window_attention


class GPTModel(LanguageModule):
    """Decoder-only LM. ``pre_process``: this stage embeds tokens; ``post_process``: it computes logits
    and the loss. Forward returns the per-token loss [b, s] when ``labels`` are given, logits [b, s, V/tp]
    otherwise, and hidden states [s, b, h] on stages without ``post_process``.

    ``position_embedding_type="mrope"`` (Qwen2-VL's multimodal RoPE, bands ``config.mrope_section``) reads
    ``position_ids`` [3, b, s] (temporal, height, width) on every stage; [b, s] or None mean text positions.

    ``pg_collection``: explicit process groups (tp, cp and pp; ep and expt_tp with MoE layers) for every
    module, sized as the config says; parallel_state's groups when None."""

    def __init__(self, config, transformer_layer_spec: ModuleSpec, vocab_size: int, max_sequence_length: int,
                 pre_process: bool = True, post_process: bool = True, fp16_lm_cross_entropy: bool = False,
                 parallel_output: bool = True, share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: Literal["learned_absolute", "rope", "yarn", "mrope",
                                                  "none"] = "learned_absolute",
                 rotary_percent: float = 1.0, rotary_base: int = 10000, rope_scaling: bool = False,
                 rope_scaling_factor: float = 8.0, scatter_embedding_sequence_parallel: bool = True,
                 seq_len_interpolation_factor: Optional[float] = None, mtp_block_spec=None, pg_collection=None,
                 vp_stage: Optional[int] = None, **kwargs):
        super().__init__(config, pg_collection)
        tp_group = None if pg_collection is None else pg_collection.tp  # None: parallel_state's
        if position_embedding_type not in ("learned_absolute", "rope", "yarn", "mrope", "none"):
            raise ValueError(f"--position-embedding-type '{position_embedding_type}' unknown; use "
                             "learned_absolute, rope, yarn, mrope or none")
        mla = getattr(config, "multi_latent_attention", False)
        if position_embedding_type == "mrope" and (mla or not config.mrope_section):
            raise ValueError("--position-embedding-type mrope needs --mrope-section and standard attention "
                             "(not --multi-latent-attention)")
        if position_embedding_type == "yarn" and not mla:
            raise NotImplementedError("--position-embedding-type yarn is supported with --multi-latent-attention "
                                      "only; use rope for standard attention")
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.fp16_lm_cross_entropy, self.parallel_output = fp16_lm_cross_entropy, parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.vp_stage = vp_stage

        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config, vocab_size, max_sequence_length, position_embedding_type=position_embedding_type,
                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel, tp_group=tp_group)
        # Multi-latent attention layers own their (YaRN) rotary embedding.
        self.model_rotary = position_embedding_type == "rope" and not mla
        if self.model_rotary:
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, rotary_percent, rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base,
                rope_scaling=rope_scaling, rope_scaling_factor=rope_scaling_factor,
                use_cpu_initialization=config.use_cpu_initialization)
        elif position_embedding_type == "mrope":
            self.rotary_pos_emb = MultimodalRotaryEmbedding(
                config.kv_channels, rotary_percent, rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base,
                cp_group=None if pg_collection is None else pg_collection.cp)
        self.decoder = TransformerBlock(config, transformer_layer_spec, pre_process=pre_process,
                                        post_process=post_process, vp_stage=vp_stage, pg_collection=pg_collection)
        # Multi-token prediction depths live on the last stage (PP > 1 is refused by the config).
        self.mtp_process = mtp_block_spec is not None and post_process
        if self.mtp_process:
            self.mtp = MultiTokenPredictionBlock(config, mtp_block_spec, vp_stage=vp_stage,
                                                 pg_collection=pg_collection)
        self.mtp_loss_stats = None
        if post_process:
            self.output_layer = build_output_layer(config, vocab_size, False, parallel_output, pre_process,
                                                   share_embeddings_and_output_weights, tp_group=tp_group)
        self.finalize_parameters()

    def set_input_tensor(self, input_tensor) -> None:
        """Feed the activation received from the previous pipeline stage."""
        if isinstance(input_tensor, (list, tuple)):
            assert len(input_tensor) == 1, "GPTModel takes one input tensor"
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def _mrope_emb(self, position_ids, decoder_input, packed_seq_params):
        """Multimodal RoPE angles [s, b, 1, d] (this CP rank's part) from [3, b, s] position ids; [b, s] or
        None (text only) give every component the text position, i.e. plain RoPE."""
        if packed_seq_params is not None:
            raise NotImplementedError("--position-embedding-type mrope with packed sequences is not supported")
        if position_ids is None or position_ids.dim() == 2:
            if position_ids is None:
                tp_size = None if self.pg_collection is None else self.pg_collection.tp.size()
                seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, self.decoder, decoder_input, self.config,
                                                                 tp_size=tp_size)
                batch = (decoder_input if decoder_input is not None else self.decoder.input_tensor).size(1)
                position_ids = torch.arange(seq_len, device=self.rotary_pos_emb.inv_freq.device).expand(batch, -1)
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        return self.rotary_pos_emb(position_ids, self.config.mrope_section)

    def _scaled_output_layer(self, hidden, weight=None):
        """The output layer with MuP's logit multiplier, for the MTP depths' logits."""
        logits, bias = self.output_layer(hidden, weight=weight)
        return scale_logits(self.config, logits), bias

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                runtime_gather_output: Optional[bool] = None, loss_mask=None, **kwargs):
        if inference_context is not None and packed_seq_params is not None:
            raise NotImplementedError("generation with packed sequences is not supported")
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, h]
        rotary_pos_emb = None
        if inference_context is not None:  # per-token positions; the context applies RoPE in attention
            window = getattr(self.config, "window_size", None)
            window_layers = None  # every layer windowed, unless --window-attn-skip-freq picks them
            if window is not None and getattr(self.config, "window_attn_skip_freq", None) is not None:
                window_layers = functools.partial(is_layer_window_attention, window,
                                                  self.config.window_attn_skip_freq)
            if self.position_embedding_type == "mrope":  # angles from the [3, b, s] positions
                inference_context.begin_forward(self.rotary_pos_emb, position_ids, window,
                                                window_layers=window_layers,
                                                rotary_freqs=self._mrope_emb(position_ids, decoder_input, None))
            else:
                rope = self.rotary_pos_emb if self.position_embedding_type == "rope" else None
                inference_context.begin_forward(rope, position_ids, window, window_layers=window_layers)
        elif self.model_rotary:
            tp_size = None if self.pg_collection is None else self.pg_collection.tp.size()
            seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, self.decoder, decoder_input, self.config,
                                                             tp_size=tp_size)
            rotary_pos_emb = self.rotary_pos_emb(seq_len)  # [S, 1, 1, d], S: the whole (CP-joined) sequence
            if self.config.context_parallel_size > 1 or packed_seq_params is not None:
                batch = (decoder_input if decoder_input is not None else self.decoder.input_tensor).size(1)
                cp_rank = None if self.pg_collection is None else self.pg_collection.cp.rank()
                rotary_pos_emb = local_rotary_pos_emb(rotary_pos_emb, self.config.context_parallel_size,
                                                      packed_seq_params, batch, cp_rank)  # [s, 1 or b, 1, d]
        elif self.position_embedding_type == "mrope":
            rotary_pos_emb = self._mrope_emb(position_ids, decoder_input, packed_seq_params)
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                              rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params,
                              inference_context=inference_context,
                              **(extra_block_kwargs or {}))
        if not self.post_process:
            return hidden
        if inference_context is not None and inference_context.last_token_index is not None:
            # Generation needs the next-token logits only: [s, b, h] -> [1, b, h] at each row's last token.
            rows = torch.arange(hidden.size(1), device=hidden.device)
            hidden = hidden[inference_context.last_token_index, rows].unsqueeze(0)
        # MTP trains only: evaluation and logits see the main prediction alone.
        mtp_hidden = []
        if self.mtp_process and labels is not None and self.training:
            hidden_all = self.mtp(input_ids, position_ids if position_ids is not None else
                                  self.default_position_ids(input_ids), hidden, attention_mask,
                                  rotary_pos_emb=rotary_pos_emb, embedding=self.embedding)
            hidden, *mtp_hidden = torch.chunk(hidden_all, 1 + self.config.mtp_num_layers, dim=0)
        logits, _ = self.output_layer(hidden, weight=self.output_weight_for_forward(),
                                      runtime_gather_output=runtime_gather_output)  # [s, b, V/tp]
        output = self.logits_or_loss(scale_logits(self.config, logits), labels)  # MuP's --mup-output-mult
        self.mtp_loss_stats = None
        if mtp_hidden:
            output, self.mtp_loss_stats = process_mtp_loss(
                output, mtp_hidden, labels, loss_mask, self._scaled_output_layer, self.output_weight_for_forward(),
                self.compute_language_model_loss, self.config)
        return output
