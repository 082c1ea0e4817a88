"""Context parallelism (the sequence split over a CP group) and packed-document attention."""
from megatron.core.context_parallel.attention import CP_COMM_TYPES, long_context_attention
from megatron.core.context_parallel.utils import (DocumentLayout, cp_local_indices, document_layout,
                                                  get_batch_on_this_cp_rank)

__all__ = ["CP_COMM_TYPES", "long_context_attention", "DocumentLayout", "cp_local_indices", "document_layout",
           "get_batch_on_this_cp_rank"]
