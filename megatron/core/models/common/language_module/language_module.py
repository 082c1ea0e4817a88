"""LanguageModule: the loss and the (optionally tied) embedding / output-layer weights of LMs."""
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule


class LanguageModule(MegatronModule):
    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token loss [b, s] in fp32 from logits [s, b, V/tp] and labels [b, s]."""
        labels = labels.transpose(0, 1).contiguous()  # [s, b]
        if getattr(self.config, "cross_entropy_loss_fusion", False):
            from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
            loss = fused_vocab_parallel_cross_entropy(logits, labels)  # [s, b], no fp32 copy of logits
            return loss.transpose(0, 1).contiguous()  # [b, s]
        if not self.fp16_lm_cross_entropy:
            logits = logits.float()
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)  # [s, b]
        return loss.transpose(0, 1).contiguous()  # [b, s]

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The word-embedding weight on the first stage, the output weight on the last one."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def setup_embeddings_and_output_layer(self) -> None:
        """Mark tied weights. Layout-independent init gives the last stage's output weight the
        embedding's values, so first and last stage start equal; ``shared_embedding`` tells
        finalize_model_grads to all-reduce their grads over the embedding group."""
        if self.pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        if not self.share_embeddings_and_output_weights:
            return
        weight = self.shared_embedding_or_output_weight()
        if weight is not None:
            weight.shared_embedding = True
            weight.shared = True
