"""BertModel: token + segment embeddings -> encoder -> masked-LM head (+ sentence-order head)."""
from typing import Literal, Optional

import torch

from megatron.core.models.bert.bert_lm_head import BertLMHead, Pooler, get_linear_layer
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule, build_output_layer
from megatron.core.process_groups_config import require_default_process_groups
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock


class BertModel(LanguageModule):
    """Encoder-only masked LM. Forward returns ``(lm_loss [b, s], binary_logits [b, 2] or None)`` when
    ``lm_labels`` is given, ``(logits [b, s, V/tp], binary_logits)`` otherwise, and hidden states
    ``[s, b, h]`` on pipeline stages without ``post_process``."""

    def __init__(self, config, num_tokentypes: int, transformer_layer_spec: ModuleSpec, vocab_size: int,
                 max_sequence_length: int, pre_process: bool = True, post_process: bool = True,
                 fp16_lm_cross_entropy: bool = False, parallel_output: bool = True,
                 share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute",
                 rotary_percent: float = 1.0, seq_len_interpolation_factor: Optional[float] = None,
                 add_binary_head: bool = True, return_embeddings: bool = False, vp_stage: Optional[int] = None,
                 pg_collection=None, apply_lm_head: bool = True, output_layer_bias: bool = True):
        # The encoder, heads and losses here read parallel_state's groups.
        require_default_process_groups(pg_collection, "BertModel")
        super().__init__(config)
        if position_embedding_type != "learned_absolute":
            raise NotImplementedError(f"BertModel supports --position-embedding-type learned_absolute only, "
                                      f"got '{position_embedding_type}'")
        if return_embeddings:
            raise NotImplementedError("BertModel(return_embeddings=True) is not supported yet")
        if config.sequence_parallel or config.context_parallel_size > 1:
            raise ValueError("BERT does not support --sequence-parallel or --context-parallel-size > 1 yet; "
                             "drop the flag")
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.fp16_lm_cross_entropy, self.parallel_output = fp16_lm_cross_entropy, parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.add_binary_head = add_binary_head
        self.vp_stage = vp_stage
        self.apply_lm_head, self.output_layer_bias = apply_lm_head, output_layer_bias

        if pre_process:
            self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length,
                                                    position_embedding_type=position_embedding_type,
                                                    num_tokentypes=num_tokentypes)
        self.encoder = TransformerBlock(config, transformer_layer_spec, pre_process=pre_process,
                                        post_process=post_process, vp_stage=vp_stage)
        if post_process:
            # apply_lm_head=False: the vocabulary projection reads the encoder's hidden states directly.
            self.lm_head = BertLMHead(config.hidden_size, config) if apply_lm_head else None
            self.output_layer = build_output_layer(config, vocab_size, output_layer_bias, parallel_output, pre_process,
                                                   share_embeddings_and_output_weights)
            self.binary_head = None
            if add_binary_head:
                self.pooler = Pooler(config.hidden_size, config.init_method, config, config.sequence_parallel)
                self.binary_head = get_linear_layer(config.hidden_size, 2, config.init_method, config)
        self.finalize_parameters()

    def set_input_tensor(self, input_tensor) -> None:
        """Feed the activation received from the previous pipeline stage."""
        if isinstance(input_tensor, (list, tuple)):
            assert len(input_tensor) == 1, "BertModel takes one input tensor"
            input_tensor = input_tensor[0]
        self.encoder.set_input_tensor(input_tensor)

    @staticmethod
    def bert_extended_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
        """[b, s] padding mask (1 = real token) -> [b, 1, s, s] boolean, True = masked.

        Only keys are masked: a pad query still attends to the real tokens, so no softmax row is empty
        (an empty row gives NaN that would leak through later layers); pad outputs never reach the loss.
        """
        b, s = attention_mask.shape
        key_is_pad = attention_mask < 0.5  # [b, s]
        return key_is_pad[:, None, None, :].expand(b, 1, s, s)

    # Megatron's name for the [b, s] positions 0..s-1.
    bert_position_ids = staticmethod(LanguageModule.default_position_ids)

    def forward(self, input_ids, attention_mask, tokentype_ids=None, lm_labels=None, inference_params=None,
                inference_context=None, **kwargs):
        if inference_params is not None or inference_context is not None:
            raise NotImplementedError("BertModel inference contexts are not supported")
        mask = self.bert_extended_attention_mask(attention_mask)
        hidden = None
        if self.pre_process:
            hidden = self.embedding(input_ids=input_ids, position_ids=self.default_position_ids(input_ids),
                                    tokentype_ids=tokentype_ids)  # [s, b, h]
        hidden = self.encoder(hidden_states=hidden, attention_mask=mask)  # [s, b, h]
        if not self.post_process:
            return hidden
        binary_logits = None
        if self.binary_head is not None:
            binary_logits = self.binary_head(self.pooler(hidden, 0))  # [b, 2]
        head = self.lm_head(hidden) if self.lm_head is not None else hidden
        logits, _ = self.output_layer(head, weight=self.output_weight_for_forward())  # [s, b, V/tp]
        return self.logits_or_loss(logits, lm_labels), binary_logits
