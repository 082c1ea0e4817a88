"""BERT under TP=2 trains to the same losses as TP=1 (8 Adam steps, fp32, dropout 0).

Layout-independent init gives both layouts the same weights; the only differences are summation
orders in split matmuls and all-reduces (~1e-7 relative per step), well inside 1e-5.
Data: random tokens with padding, two segments, ~15% of positions as targets, random SOP labels.
"""
import torch
import torch.nn.functional as F

from tests.fixtures.tiny_gpt import tiny_config
from tests.parallel.dist_utils import run_distributed

ITERS, BATCH, SEQ, VOCAB = 8, 4, 16, 128


def _batch(gen):
    tokens = torch.randint(5, VOCAB, (BATCH, SEQ), generator=gen)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=gen)
    padding = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()  # 1 = real token
    types = (torch.arange(SEQ)[None, :] >= (lengths // 2)[:, None]).long() * padding
    loss_mask = ((torch.rand(BATCH, SEQ, generator=gen) < 0.15).long() * padding).float()
    loss_mask[:, 1] = 1.0
    labels = torch.where(loss_mask > 0, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), -1)
    sop = torch.randint(0, 2, (BATCH,), generator=gen)
    return tokens, padding, types, labels, loss_mask, sop


def _train(tp, binary_head):
    from megatron.core import parallel_state as ps
    from megatron.core.models.bert.bert_layer_specs import get_bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    cfg = tiny_config(tensor_model_parallel_size=tp)
    model = BertModel(cfg, 2 if binary_head else 0, get_bert_layer_local_spec(), VOCAB, SEQ,
                      add_binary_head=binary_head, share_embeddings_and_output_weights=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(ITERS):
        tokens, padding, types, labels, loss_mask, sop = _batch(gen)
        lm, sop_logits = model(tokens, padding, tokentype_ids=types if binary_head else None, lm_labels=labels)
        loss = (lm * loss_mask).sum() / loss_mask.sum()
        if binary_head:
            loss = loss + F.cross_entropy(sop_logits, sop)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ps.destroy_model_parallel()
    return losses


def _tp2_and_tp1():
    return {head: (_train(2, head), _train(1, head)) for head in (True, False)}


def test_bert_tp2_matches_tp1():
    for per_rank in run_distributed(_tp2_and_tp1, 2):
        for head, (tp2, tp1) in per_rank.items():
            assert tp1[-1] < tp1[0], tp1  # it trains
            torch.testing.assert_close(torch.tensor(tp2), torch.tensor(tp1), rtol=1e-5, atol=0)
