"""Single-process pieces of context parallelism: the flash kernels (torch's CPU flash ops) against the
explicit-softmax kernel, the LSE merge, the load-balanced split and the document layout."""
import torch

from megatron.core.context_parallel import kernels as K
from megatron.core.context_parallel.utils import DocumentLayout, cp_local_indices, get_batch_on_this_cp_rank


def _qkv(b=2, n=4, g=2, s=32, d=16):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, s, d, generator=gen) for h in (n, g, g, n)]


def test_flash_matches_math_with_global_lse_backward():
    """Backward of a key block from the merged (global) output and LSE equals the math kernel's;
    summing the two halves' grads gives the whole-block grads. fp32: 1e-5."""
    q, k, v, dout = _qkv()
    scale = 0.25
    for causal in (False, True):
        m = K.BlockMask(causal=causal)
        (o1, l1), (o2, l2) = K.math_forward(q, k, v, scale, m), K.flash_forward(q, k, v, scale, m)
        assert torch.allclose(o1, o2, atol=1e-5) and torch.allclose(l1, l2, atol=1e-5)
        for a, b in zip(K.math_backward(dout, q, k, v, o1, l1, scale, m),
                        K.flash_backward(dout, q, k, v, o1, l1, scale, m)):
            assert torch.allclose(a, b, atol=1e-5)
    full = K.BlockMask()
    out, lse = K.math_forward(q, k, v, scale, full)
    halves = [K.flash_forward(q, k[:, :, i:i + 16], v[:, :, i:i + 16], scale, full) for i in (0, 16)]
    merged, merged_lse = K.merge(*halves[0], *halves[1])
    assert torch.allclose(merged, out, atol=1e-5) and torch.allclose(merged_lse, lse, atol=1e-5)
    ref = K.math_backward(dout, q, k, v, out, lse, scale, full)
    parts = [K.flash_backward(dout, q, k[:, :, i:i + 16], v[:, :, i:i + 16], out, lse, scale, full) for i in (0, 16)]
    assert torch.allclose(parts[0][0] + parts[1][0], ref[0], atol=1e-5)
    assert torch.allclose(torch.cat([parts[0][1], parts[1][1]], 2), ref[1], atol=1e-5)


def test_merge_keeps_fully_masked_rows_finite():
    out = torch.ones(1, 1, 2, 4)
    lse = torch.tensor([[[float("-inf"), 0.0]]])
    merged, new = K.merge(out * 0, lse, out, torch.full_like(lse, float("-inf")))
    assert torch.isfinite(merged).all() and new[0, 0, 0] == float("-inf") and new[0, 0, 1] == 0.0


def test_load_balanced_split_and_batch_slicing():
    assert cp_local_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_local_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    batch = {"tokens": torch.arange(16)[None], "attention_mask": torch.zeros(1, 1, 16, 16),
             "cu_seqlens": torch.tensor([[0, 5, 16]])}
    local = get_batch_on_this_cp_rank(batch, cp_size=4, cp_rank=1)
    assert local["tokens"].tolist() == [[2, 3, 12, 13]]
    assert local["attention_mask"].shape == (1, 1, 4, 16) and local["cu_seqlens"] is batch["cu_seqlens"]


def test_document_layout():
    # sample 0: documents [0, 3) [3, 8); sample 1: one document continuing across the sample start
    layout = DocumentLayout(torch.tensor([0, 3, 10, 16]), batch=2, seq_len=8)
    assert layout.pos_in_doc.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]]
    doc = layout.doc.tolist()
    assert doc[0][0] == doc[0][2] != doc[0][3] == doc[0][7] != doc[1][0]
    assert doc[1][0] == doc[1][1] != doc[1][2] == doc[1][7]
