"""T5Model: shared embedding -> encoder; decoder with cross-attention -> LM head tied to the embedding."""
from dataclasses import replace
from typing import Literal, Optional, Tuple

import torch

from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule, build_output_layer
from megatron.core.process_groups_config import require_default_process_groups
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import lazy_names

# Megatron's mask / position helpers that T5Model does not call, resolved on first use.
__getattr__ = lazy_names(__name__, {name: "megatron.core._compat.t5_model" for name in (
    "t5_extended_attention_mask", "t5_position_ids")})


def t5_attention_masks(enc_mask: torch.Tensor, dec_mask: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[b, se] / [b, sd] padding masks (1 = real token) -> boolean attention masks, True = masked:
    encoder [b, 1, se, se], decoder [b, 1, sd, sd] (causal), encoder-decoder [b, 1, sd, se].

    Only keys are masked (plus the future, for the decoder), so no softmax row is ever empty; the
    outputs at pad positions are not used by the loss.
    """
    b, se = enc_mask.shape
    sd = dec_mask.shape[1]
    enc_key_pad = (enc_mask < 0.5)[:, None, None, :]  # [b, 1, 1, se]
    dec_key_pad = (dec_mask < 0.5)[:, None, None, :]  # [b, 1, 1, sd]
    future = torch.triu(torch.ones(sd, sd, dtype=torch.bool, device=dec_mask.device), diagonal=1)
    return enc_key_pad.expand(b, 1, se, se), dec_key_pad | future, enc_key_pad.expand(b, 1, sd, se)


class T5LMHead(MegatronModule):
    """Decoder hidden states -> vocab logits (column-parallel, with bias; weight tied to the embedding)."""

    def __init__(self, config, parallel_output: bool, vocab_size: int, pre_process: bool = True,
                 share_embeddings_and_output_weights: bool = False, tp_group=None):
        if tp_group is not None:
            raise NotImplementedError("T5LMHead(tp_group=...): the head uses parallel_state's TP group")
        super().__init__(config)
        self.output_layer = build_output_layer(config, vocab_size, True, parallel_output, pre_process,
                                               share_embeddings_and_output_weights)

    def forward(self, hidden_states, word_embeddings_weight=None):
        logits, _ = self.output_layer(hidden_states, weight=word_embeddings_weight)
        return logits  # [s, b, V/tp]


class T5Model(LanguageModule):
    """Encoder-decoder LM. ``config`` describes the decoder, ``encoder_config`` the encoder (it may
    have another layer count). Forward returns the per-token loss [b, sd] with ``lm_labels``, logits
    [b, sd, V/tp] without."""

    def __init__(self, config, encoder_config, transformer_encoder_layer_spec, transformer_decoder_layer_spec,
                 vocab_size: int, max_sequence_length: int, pre_process: bool = True, post_process: bool = True,
                 fp16_lm_cross_entropy: bool = False, parallel_output: bool = True,
                 share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: Literal["learned_absolute", "rope", "relative"] = "learned_absolute",
                 rotary_percent: float = 1.0, seq_len_interpolation_factor: Optional[float] = None,
                 relative_attention_num_buckets: int = 32, relative_attention_max_distance: int = 128,
                 add_encoder: bool = True, add_decoder: bool = True, pg_collection=None,
                 vp_stage: Optional[int] = None, **kwargs):
        # The encoder/decoder stacks, heads and losses here read parallel_state's groups.
        require_default_process_groups(pg_collection, "T5Model")
        super().__init__(config)
        if position_embedding_type != "learned_absolute":
            raise NotImplementedError(f"T5Model supports --position-embedding-type learned_absolute only, "
                                      f"got '{position_embedding_type}'")
        if not (add_encoder and add_decoder and pre_process and post_process):
            raise NotImplementedError("T5Model runs as one pipeline stage holding encoder and decoder; "
                                      "--pipeline-model-parallel-size > 1 is not supported yet")
        for c in (config, encoder_config):
            if c.sequence_parallel or c.context_parallel_size > 1:
                raise ValueError("T5 does not support --sequence-parallel or --context-parallel-size > 1 yet")
        self.encoder_config = encoder_config
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.add_encoder, self.add_decoder = add_encoder, add_decoder
        self.fp16_lm_cross_entropy, self.parallel_output = fp16_lm_cross_entropy, parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type

        self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length,
                                                position_embedding_type=position_embedding_type)
        self.encoder = TransformerBlock(encoder_config, transformer_encoder_layer_spec)
        self.decoder = TransformerBlock(config, transformer_decoder_layer_spec)
        self.lm_head = T5LMHead(config, parallel_output, vocab_size, pre_process,
                                share_embeddings_and_output_weights)
        self.finalize_parameters()

    @property
    def output_layer(self):
        """LanguageModule's name for the vocab projection (it lives in ``lm_head``)."""
        return self.lm_head.output_layer

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        assert input_tensor is None, "T5Model is a single pipeline stage"

    def forward(self, encoder_input_ids, decoder_input_ids, encoder_attn_mask, decoder_attn_mask,
                encoder_decoder_attn_mask, lm_labels=None, encoder_hidden_states=None,
                output_encoder_hidden_only: bool = False, inference_params=None, inference_context=None,
                packed_seq_params=None, **kwargs):
        if inference_params is not None or inference_context is not None or packed_seq_params is not None:
            raise NotImplementedError("T5Model inference contexts and packed sequences are not supported")
        if encoder_hidden_states is None:
            enc_in = self.embedding(input_ids=encoder_input_ids,
                                    position_ids=self.default_position_ids(encoder_input_ids))  # [se, b, h]
            encoder_hidden_states = self.encoder(hidden_states=enc_in, attention_mask=encoder_attn_mask)
        if output_encoder_hidden_only:
            return encoder_hidden_states
        dec_in = self.embedding(input_ids=decoder_input_ids,
                                position_ids=self.default_position_ids(decoder_input_ids))  # [sd, b, h]
        hidden = self.decoder(hidden_states=dec_in, attention_mask=decoder_attn_mask,
                              context=encoder_hidden_states, context_mask=encoder_decoder_attn_mask)  # [sd, b, h]
        logits = self.lm_head(hidden, word_embeddings_weight=self.output_weight_for_forward())  # [sd, b, V/tp]
        return self.logits_or_loss(logits, lm_labels)


def encoder_config_from(config, encoder_num_layers: int):
    """The decoder config with the encoder's layer count (Megatron builds the encoder from its own config)."""
    return replace(config, num_layers=encoder_num_layers)
