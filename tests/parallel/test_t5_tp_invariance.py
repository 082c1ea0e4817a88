"""T5 under TP=2 trains to the same losses as TP=1 (8 Adam steps, fp32, dropout 0), with different
encoder and decoder depths, padded encoder and decoder inputs and a tied LM head.

Layout-independent init gives both layouts the same weights; only summation orders differ
(~1e-7 relative per step), well inside 1e-5.
"""
import torch

from tests.fixtures.tiny_gpt import tiny_config
from tests.parallel.dist_utils import run_distributed

ITERS, BATCH, ENC, DEC, VOCAB = 8, 4, 16, 8, 128


def _batch(gen):
    from megatron.core.models.T5.t5_model import t5_attention_masks
    enc = torch.randint(0, VOCAB, (BATCH, ENC), generator=gen)
    dec = torch.randint(0, VOCAB, (BATCH, DEC), generator=gen)
    enc_len = torch.randint(ENC // 2, ENC + 1, (BATCH,), generator=gen)
    dec_len = torch.randint(2, DEC + 1, (BATCH,), generator=gen)
    enc_mask = (torch.arange(ENC)[None, :] < enc_len[:, None]).long()
    dec_mask = (torch.arange(DEC)[None, :] < dec_len[:, None]).long()
    labels = torch.where(dec_mask > 0, torch.randint(0, VOCAB, (BATCH, DEC), generator=gen), -1)
    return (enc, dec, *t5_attention_masks(enc_mask, dec_mask)), labels, dec_mask.float()


def _train(tp):
    from megatron.core import parallel_state as ps
    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_model import encoder_config_from
    from megatron.core.models.T5.t5_spec import (
        get_t5_decoder_with_local_block_spec,
        get_t5_encoder_with_local_block_spec,
    )
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    cfg = tiny_config(num_layers=1, tensor_model_parallel_size=tp)
    model = T5Model(cfg, encoder_config_from(cfg, 2), get_t5_encoder_with_local_block_spec(2),
                    get_t5_decoder_with_local_block_spec(1), VOCAB, ENC, share_embeddings_and_output_weights=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(ITERS):
        inputs, labels, loss_mask = _batch(gen)
        loss = (model(*inputs, lm_labels=labels) * loss_mask).sum() / loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ps.destroy_model_parallel()
    return losses


def _tp2_and_tp1():
    return _train(2), _train(1)


def test_t5_tp2_matches_tp1():
    for tp2, tp1 in run_distributed(_tp2_and_tp1, 2):
        assert tp1[-1] < tp1[0], tp1  # it trains
        torch.testing.assert_close(torch.tensor(tp2), torch.tensor(tp1), rtol=1e-5, atol=0)
