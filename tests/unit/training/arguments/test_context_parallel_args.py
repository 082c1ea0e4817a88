"""--context-parallel-size / --cp-comm-type / --reset-attention-mask validation: one line naming the flag."""
import pytest

from megatron.training.arguments import ArgumentError
from tests.unit.training.arguments.test_arguments import _args

NO_DROPOUT = "--attention-dropout 0 "


@pytest.mark.parametrize("extra,world,needle", [
    (NO_DROPOUT + "--context-parallel-size 2 --seq-length 34 --max-position-embeddings 34", 2,
     "--seq-length (34) must be divisible by 2 x --context-parallel-size (2)"),
    (NO_DROPOUT + "--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel --seq-length 36 "
     "--max-position-embeddings 36", 4, "x --tensor-model-parallel-size (2) with --sequence-parallel"),
    (NO_DROPOUT + "--context-parallel-size 2 --attention-backend unfused", 2,
     "--attention-backend unfused has no log-sum-exp path"),
    ("--context-parallel-size 2", 2, "pass --attention-dropout 0"),
    ("--cp-comm-type p2p a2a a2a", 1, "--cp-comm-type has 3 values; give one, or one per layer (--num-layers 2)"),
    ("--cp-comm-type a2a+p2p", 1, "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P"),
    (NO_DROPOUT + "--context-parallel-size 4 --cp-comm-type p2p a2a+p2p", 4,
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),  # one layer of two asks for it
    (NO_DROPOUT + "--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 3", 4,
     "--hierarchical-context-parallel-sizes 2 3 must be positive and multiply to --context-parallel-size (4)"),
    ("--hierarchical-context-parallel-sizes 2 2", 1, "multiply to --context-parallel-size (1)"),
    (NO_DROPOUT + "--context-parallel-size 8 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 2", 8,
     "--cp-comm-type a2a+p2p takes two --hierarchical-context-parallel-sizes (all-to-all size, ring size), got 3"),
    (NO_DROPOUT + "--context-parallel-size 8 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 8 1", 8,
     "--cp-comm-type a2a+p2p splits the 4 attention heads per TP rank over the all-to-all size 8"),
    ("--cp-comm-type ring", 1, "--cp-comm-type 'ring' unknown"),
    (NO_DROPOUT + "--context-parallel-size 8 --cp-comm-type a2a", 8, "--cp-comm-type a2a splits the 4 attention heads"),
    ("--reset-attention-mask --no-create-attention-mask-in-dataloader", 1, "pass --attention-dropout 0"),
])
def test_context_parallel_errors(extra, world, needle):
    with pytest.raises(ArgumentError) as e:
        _args(extra, world_size=world)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_valid_layouts_and_document_path():
    a = _args(NO_DROPOUT + "--context-parallel-size 2 --cp-comm-type allgather a2a", world_size=4)
    assert a.data_parallel_size == 2 and a.cp_comm_type == ["allgather", "a2a"]
    assert _args("--cp-comm-type all_gather").cp_comm_type == ["allgather"]
    h = _args(NO_DROPOUT + "--context-parallel-size 4 --cp-comm-type a2a+p2p p2p "
              "--hierarchical-context-parallel-sizes 2 2", world_size=4)
    assert h.cp_comm_type == ["a2a+p2p", "p2p"] and h.hierarchical_context_parallel_sizes == [2, 2]
    # Per-document attention replaces the dense mask when it can (no attention dropout).
    assert not _args(NO_DROPOUT + "--reset-attention-mask").create_attention_mask_in_dataloader
    assert _args("--reset-attention-mask").create_attention_mask_in_dataloader  # dropout: dense mask kept
    # Without per-document masks the loader's causal mask is never read: not built, at any length.
    assert not _args("").create_attention_mask_in_dataloader
    assert not _args("--seq-length 131072 --max-position-embeddings 131072").create_attention_mask_in_dataloader
