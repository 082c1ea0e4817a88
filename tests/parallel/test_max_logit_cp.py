"""Under context parallelism each rank's max attention logit (its two load-balanced query chunks against the
all-gathered keys), reduced with MAX over the CP group, equals the brute-force max over the whole sequence's
masked logit matrix: causal, and causal within packed documents. fp32, 1e-6 relative."""
import torch

from megatron.core.context_parallel.utils import DocumentLayout, cp_local_indices
from megatron.core.transformer.max_logit import context_parallel_max_attention_logit
from tests.parallel.dist_utils import run_distributed

S, B, NP, NG, HN, SCALE = 16, 2, 4, 2, 8, 0.4


def _brute(q, k, keep):
    kk = k.repeat_interleave(NP // NG, dim=2)
    logits = torch.einsum("qbnd,kbnd->bnqk", q.double(), kk.double()) * SCALE
    return logits.masked_fill(~keep, float("-inf")).amax(dim=(0, 2, 3)).float()


def _rank(packed):
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(S, B, NP, HN, generator=g), torch.randn(S, B, NG, HN, generator=g)
    cp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    idx = cp_local_indices(S, cp, rank)
    layout = DocumentLayout(torch.tensor([0, 5, 11, 16, 19, 32]), B, S) if packed else None
    got = context_parallel_max_attention_logit(q[idx], k[idx], SCALE, torch.distributed.group.WORLD, layout)
    torch.distributed.all_reduce(got, op=torch.distributed.ReduceOp.MAX)
    keep = torch.ones(S, S, dtype=torch.bool).tril()
    if packed:
        keep = keep & (layout.doc[:, :, None] == layout.doc[:, None, :])[:, None]
    return got, _brute(q, k, keep)


def test_context_parallel_max_equals_whole_sequence():
    for packed in (False, True):
        for got, want in run_distributed(_rank, 2, packed):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
