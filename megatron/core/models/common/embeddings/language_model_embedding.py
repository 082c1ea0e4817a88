"""Token (+ learned absolute position) embeddings producing ``[s, b, h]`` (``[s/tp, b, h]`` under SP)."""
from typing import Literal

import torch

from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.mup import scale_embeddings
from megatron.core.utils import get_device


class LanguageModelEmbedding(MegatronModule):
    def __init__(self, config, vocab_size: int, max_sequence_length: int,
                 position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute",
                 num_tokentypes: int = 0, scatter_to_sequence_parallel: bool = True, tp_group=None):
        super().__init__(config)
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        self.tp_group = tp_group  # None: parallel_state's TP group
        # Reduce-scatter straight out of the vocab-parallel lookup only without position embeddings
        # (as Megatron): otherwise the replicated position table would need a split without gather.
        self.reduce_scatter_embeddings = (not self.add_position_embedding and not num_tokentypes
                                          and config.sequence_parallel and scatter_to_sequence_parallel)
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=config.embedding_init_method, config=config,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings, tp_group=tp_group)
        if self.add_position_embedding:
            device = torch.device("cpu") if config.use_cpu_initialization else get_device()
            self.position_embeddings = torch.nn.Embedding(max_sequence_length, config.hidden_size,
                                                          device=device, dtype=config.params_dtype)
            if config.perform_initialization:
                config.embedding_init_method(self.position_embeddings.weight.data)
            self.position_embeddings.weight.init_fn = config.embedding_init_method
        self.num_tokentypes = num_tokentypes
        if num_tokentypes > 0:  # BERT segment A/B embeddings, replicated over TP like the position table
            device = torch.device("cpu") if config.use_cpu_initialization else get_device()
            self.tokentype_embeddings = torch.nn.Embedding(num_tokentypes, config.hidden_size,
                                                           device=device, dtype=config.params_dtype)
            if config.perform_initialization:
                config.embedding_init_method(self.tokentype_embeddings.weight.data)
            self.tokentype_embeddings.weight.init_fn = config.embedding_init_method
        else:
            self.tokentype_embeddings = None
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def zero_parameters(self):
        for p in self.parameters():
            p.data.zero_()
            p.shared = True

    def forward(self, input_ids, position_ids, tokentype_ids=None) -> torch.Tensor:
        emb = self.word_embeddings(input_ids)  # [b, s, h] ([s/tp, b, h] when reduce-scattered)
        if self.add_position_embedding:
            emb = emb + self.position_embeddings(position_ids)
        if tokentype_ids is not None:
            if self.tokentype_embeddings is None:
                raise ValueError("tokentype_ids given to an embedding built with num_tokentypes=0")
            emb = emb + self.tokentype_embeddings(tokentype_ids)  # [b, s, h]
        emb = scale_embeddings(self.config, emb)  # MuP's --mup-embedding-mult
        if not self.reduce_scatter_embeddings:
            emb = emb.transpose(0, 1).contiguous()  # [s, b, h]
        if self.config.fp32_residual_connection:
            emb = emb.float()
        if not self.config.sequence_parallel:
            return self.embedding_dropout(emb)
        if not self.reduce_scatter_embeddings and self.scatter_to_sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb, group=self.tp_group)  # [s/tp, b, h]
        with get_cuda_rng_tracker().fork():
            return self.embedding_dropout(emb)
