"""GPTModel: embedding -> transformer block -> output layer -> per-token loss, one pipeline stage at a time."""
from typing import Literal, Optional

import torch

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule, build_output_layer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock


class GPTModel(LanguageModule):
    """Decoder-only LM. ``pre_process``: this stage embeds tokens; ``post_process``: it computes logits
    and the loss. Forward returns the per-token loss [b, s] when ``labels`` are given, logits [b, s, V/tp]
    otherwise, and hidden states [s, b, h] on stages without ``post_process``."""

    def __init__(self, config, transformer_layer_spec: ModuleSpec, vocab_size: int, max_sequence_length: int,
                 pre_process: bool = True, post_process: bool = True, fp16_lm_cross_entropy: bool = False,
                 parallel_output: bool = True, share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute",
                 rotary_percent: float = 1.0, rotary_base: int = 10000, rope_scaling: bool = False,
                 rope_scaling_factor: float = 8.0, scatter_embedding_sequence_parallel: bool = True,
                 seq_len_interpolation_factor: Optional[float] = None, mtp_block_spec=None, pg_collection=None,
                 vp_stage: Optional[int] = None, **kwargs):
        super().__init__(config)
        from megatron.core.process_groups_config import require_default_process_groups
        require_default_process_groups(pg_collection, "GPTModel")
        if mtp_block_spec is not None:
            raise NotImplementedError("multi-token prediction (--mtp-num-layers) is not supported yet")
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(f"--position-embedding-type '{position_embedding_type}' unknown; use "
                             "learned_absolute, rope or none")
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
                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel)
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, rotary_percent, rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base,
                rope_scaling=rope_scaling, rope_scaling_factor=rope_scaling_factor,
                use_cpu_initialization=config.use_cpu_initialization)
        self.decoder = TransformerBlock(config, transformer_layer_spec, pre_process=pre_process,
                                        post_process=post_process, vp_stage=vp_stage)
        if post_process:
            self.output_layer = build_output_layer(config, vocab_size, False, parallel_output, pre_process,
                                                   share_embeddings_and_output_weights)
        self.finalize_parameters()

    def set_input_tensor(self, input_tensor) -> None:
        """Feed the activation received from the previous pipeline stage."""
        if isinstance(input_tensor, (list, tuple)):
            assert len(input_tensor) == 1, "GPTModel takes one input tensor"
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                runtime_gather_output: Optional[bool] = None, loss_mask=None, **kwargs):
        if inference_context is not None or packed_seq_params is not None:
            raise NotImplementedError("inference contexts and packed sequences are not supported yet")
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, h]
        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, self.decoder, decoder_input, self.config)
            rotary_pos_emb = self.rotary_pos_emb(seq_len)  # [s, 1, 1, d]
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                              rotary_pos_emb=rotary_pos_emb, **(extra_block_kwargs or {}))
        if not self.post_process:
            return hidden
        logits, _ = self.output_layer(hidden, weight=self.output_weight_for_forward(),
                                      runtime_gather_output=runtime_gather_output)  # [s, b, V/tp]
        return self.logits_or_loss(logits, labels)
