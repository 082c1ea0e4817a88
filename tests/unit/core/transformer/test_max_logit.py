"""The recorded max attention logit equals a brute-force max over the whole masked [s, s] logit matrix:
causal, packed documents, GQA, explicit masks and sliding windows, with tiles smaller than the sequence so
that the tiling and the skipped tiles are exercised. fp32 on CPU: the same products in another grouping, so
1e-6 relative."""
import pytest
import torch

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.max_logit import max_attention_logit
from tests.fixtures.tiny_gpt import tiny_config


def _qk(s=13, b=2, np_=4, ng=2, hn=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, np_, hn, generator=g), torch.randn(s, b, ng, hn, generator=g)


def _brute(q, k, scale, keep):
    """keep: bool broadcastable to [b, np, sq, sk]."""
    rep = q.size(2) // k.size(2)
    kk = k.repeat_interleave(rep, dim=2)
    logits = torch.einsum("qbnd,kbnd->bnqk", q.double(), kk.double()) * scale  # the full matrix
    return logits.masked_fill(~keep, float("-inf")).amax(dim=(0, 2, 3)).float()


def _causal(s):
    return torch.ones(s, s, dtype=torch.bool).tril()


@pytest.mark.parametrize("blocks", [(None, None), (4, 3), (1, 5), (13, 1)])
def test_causal_gqa(blocks):
    q, k = _qk()
    got = max_attention_logit(q, k, 0.3, causal=True, block_q=blocks[0], block_k=blocks[1])
    torch.testing.assert_close(got, _brute(q, k, 0.3, _causal(13)), rtol=1e-6, atol=0)


def test_packed_documents():
    q, k = _qk(s=12)
    doc = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [3] * 2 + [4] * 10])  # [b, s]
    keep = _causal(12) & (doc[:, :, None] == doc[:, None, :])[:, None]
    got = max_attention_logit(q, k, 0.5, causal=True, q_doc=doc, k_doc=doc, block_q=5, block_k=4)
    torch.testing.assert_close(got, _brute(q, k, 0.5, keep), rtol=1e-6, atol=0)
    # Without the documents the max would differ (a cross-document logit is larger): the mask matters.
    assert not torch.equal(got, max_attention_logit(q, k, 0.5, causal=True))


def test_explicit_mask_and_window():
    q, k = _qk(s=10, np_=4, ng=4)
    g = torch.Generator().manual_seed(1)
    masked = torch.rand(2, 1, 10, 10, generator=g) < 0.3
    masked &= ~torch.eye(10, dtype=torch.bool)  # every query keeps a key
    got = max_attention_logit(q, k, 1.0, causal=False, attention_mask=masked, block_q=3, block_k=4)
    torch.testing.assert_close(got, _brute(q, k, 1.0, ~masked), rtol=1e-6, atol=0)
    i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
    band = (j >= i - 2) & (j <= i)
    got = max_attention_logit(q, k, 1.0, causal=True, window=(2, 0), block_q=2, block_k=3)
    torch.testing.assert_close(got, _brute(q, k, 1.0, band), rtol=1e-6, atol=0)


def _core(**overrides):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    cfg = tiny_config(num_query_groups=2, log_max_attention_logit=True, **overrides)
    return DotProductAttention(cfg, 1, AttnMaskType.causal)


def test_core_attention_records_running_max_in_training_only():
    """Megatron's current_max_attn_logits: the max over micro-batches since the last reset, training only."""
    core = _core()
    q1, k1 = _qk(s=8, hn=8)
    q2, k2 = _qk(s=8, hn=8, seed=1)
    v = torch.randn(8, 2, 2, 8)
    core.eval()
    core(q1, k1, v)
    assert core.current_max_attn_logits is None
    core.train()
    core(q1, k1, v)
    core(q2, k2, v)
    scale = 8 ** -0.5
    want = torch.maximum(_brute(q1, k1, scale, _causal(8)), _brute(q2, k2, scale, _causal(8)))
    torch.testing.assert_close(core.current_max_attn_logits, want, rtol=1e-6, atol=0)


def test_core_attention_packed_sequence():
    core = _core()
    core.train()
    q, k = _qk(s=8, hn=8)
    cu = torch.tensor([0, 3, 8, 10, 16], dtype=torch.int32)  # over b * s = 16 tokens, sample by sample
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    core(q, k, torch.randn(8, 2, 2, 8), packed_seq_params=packed)
    doc = torch.tensor([[0] * 3 + [1] * 5, [2] * 2 + [3] * 6])
    keep = _causal(8) & (doc[:, :, None] == doc[:, None, :])[:, None]
    torch.testing.assert_close(core.current_max_attn_logits, _brute(q, k, 8 ** -0.5, keep), rtol=1e-6, atol=0)
