"""Context parallelism (the sequence split over a CP group) and packed-document attention."""
from megatron.core.context_parallel.utils import (
    CP_COMM_TYPES,
    DocumentLayout,
    cp_local_indices,
    document_layout,
    get_batch_on_this_cp_rank,
)

__all__ = ["CP_COMM_TYPES", "long_context_attention", "DocumentLayout", "cp_local_indices", "document_layout",
           "get_batch_on_this_cp_rank"]


def __getattr__(name):
    """The attention entry points load on first use: their @torch.compiler.disable imports torch._dynamo,
    ~1.5 s of every process start that never runs context parallelism or packed documents."""
    if name == "long_context_attention":
        from megatron.core.context_parallel import attention  # lazy: torch._dynamo import, ~1.3 s (measured)
        return getattr(attention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
