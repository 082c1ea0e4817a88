"""LanguageModule: the loss and the (optionally tied) embedding / output-layer weights of LMs."""
import torch

from megatron.core import tensor_parallel
from megatron.core.fusions.compile import compile_available
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.process_groups_config import check_collection_sizes
from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.transformer.initialize import initialize_parameters
from megatron.core.transformer.module import MegatronModule


def build_output_layer(config, vocab_size: int, bias: bool, parallel_output: bool, pre_process: bool,
                       share_embeddings_and_output_weights: bool,
                       tp_group=None) -> tensor_parallel.ColumnParallelLinear:
    """Column-parallel vocab projection [s, b, h] -> [s, b, V/tp]; with tied weights on the first
    stage it allocates no weight and takes the embedding's at forward time."""
    # MuP: an untied output layer starts like the embeddings (the base std), not like the hidden weights.
    untied_mup = getattr(config, "use_mup", False) and not share_embeddings_and_output_weights
    # --defer-embedding-wgrad-compute: the buffers its weight-gradient GEMMs wait in until the step's end
    defer = getattr(config, "defer_embedding_wgrad_compute", False)
    return tensor_parallel.ColumnParallelLinear(
        config.hidden_size, vocab_size, config=config,
        init_method=config.embedding_init_method if untied_mup else config.init_method, bias=bias,
        skip_bias_add=False, gather_output=not parallel_output,
        skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights, tp_group=tp_group,
        embedding_activation_buffer=[] if defer else None, grad_output_buffer=[] if defer else None)


class LanguageModule(MegatronModule):
    """``pg_collection``: the explicit process groups a subclass threads through its modules (its ``tp``
    group also splits the loss's vocabulary); parallel_state's groups when None."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config)
        self.pg_collection = pg_collection
        check_collection_sizes(pg_collection, config, type(self).__name__)
        # None: the losses use parallel_state's TP group (the default model, unchanged).
        self.loss_tp_group = None if pg_collection is None else pg_collection.tp

    @property
    def embedding_activation_buffer(self):
        """The output layer's parked inputs under --defer-embedding-wgrad-compute (Megatron's name), else None."""
        return getattr(self.__dict__.get("_modules", {}).get("output_layer"), "embedding_activation_buffer", None)

    @property
    def grad_output_buffer(self):
        """The output layer's parked output gradients under --defer-embedding-wgrad-compute, else None."""
        return getattr(self.__dict__.get("_modules", {}).get("output_layer"), "grad_output_buffer", None)

    def finalize_parameters(self) -> None:
        """Last step of a subclass __init__: TP defaults and the DP all-reduce flag on every parameter,
        tied-weight marks, then layout-independent initialization."""
        for p in self.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(p)
            if not hasattr(p, "allreduce"):
                p.allreduce = True
        if self.pre_process or self.post_process:
            self.setup_embeddings_and_output_layer()
        if self.config.perform_initialization:
            initialize_parameters(self, pg_collection=self.pg_collection)

    @staticmethod
    def default_position_ids(token_ids: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids -> [b, s] positions 0..s-1."""
        s = token_ids.size(1)
        return torch.arange(s, dtype=torch.long, device=token_ids.device).unsqueeze(0).expand_as(token_ids)

    def output_weight_for_forward(self):
        """The weight to hand the output layer: the shared one when tied, else None (its own)."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return None

    def logits_or_loss(self, logits: torch.Tensor, labels) -> torch.Tensor:
        """Logits [s, b, V/tp] -> [b, s, V/tp] without labels, the per-token loss [b, s] with them."""
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V/tp]
        return self.compute_language_model_loss(labels, logits)  # [b, s]

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token loss [b, s] in fp32 from logits [s, b, V/tp] and labels [b, s]."""
        labels = labels.transpose(0, 1).contiguous()  # [s, b]
        if getattr(self.config, "cross_entropy_loss_fusion", False) or self._fused_loss_is_same(logits):
            loss = fused_vocab_parallel_cross_entropy(logits, labels, self.loss_tp_group)  # [s, b], no fp32 logits
            return loss.transpose(0, 1).contiguous()  # [b, s]
        if not self.fp16_lm_cross_entropy:
            logits = logits.float()
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels, tp_group=self.loss_tp_group)  # [s, b]
        return loss.transpose(0, 1).contiguous()  # [b, s]

    def _fused_loss_is_same(self, logits: torch.Tensor) -> bool:
        """16-bit logits on CUDA: the chunked, compiled loss does the eager path's fp32 math (same numbers to
        fp32 rounding, same bf16 gradient) without the fp32 copies of [s, b, V], so it is the default there."""
        return (logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16)
                and not self.fp16_lm_cross_entropy and compile_available())

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
        if getattr(self.config, "use_mup", False):  # MuP's optimizer rules keep the base LR for these
            for param in (self.embedding.parameters() if self.pre_process else ()):
                param.is_embedding_parameter = True
            if self.post_process and self.output_layer.weight is not None:
                self.output_layer.weight.is_embedding_parameter = True
        if not self.share_embeddings_and_output_weights:
            return
        weight = self.shared_embedding_or_output_weight()
        if weight is not None:
            weight.shared_embedding = True
            weight.shared = True
            if self.pre_process and self.post_process:
                # Used twice on this stage: the output layer's fused wgrad goes into main_grad and
                # hands autograd zeros, but the embedding lookup's grad arrives in `.grad`, so DDP
                # must still add `.grad` into main_grad (Megatron's `zero_out_wgrad`).
                weight.zero_out_wgrad = True
