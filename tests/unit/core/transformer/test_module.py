"""Float16Module: bf16 parameters, fp32 losses and logits, tied embeddings."""
import torch

from megatron.core.transformer.module import Float16Module
from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt

S, B = 6, 2


def _cfg(**kw):
    base = dict(num_query_groups=2, use_cpu_initialization=True)  # CPU references, even on a GPU host
    base.update(kw)
    return tiny_config(**base)


def _gpt(cfg, share_embeddings_and_output_weights=False, **kw):
    return tiny_gpt(cfg, max_sequence_length=S, share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                    **kw)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (B, S), generator=g)
    return ids, torch.arange(S).expand(B, S)


def test_float16_module_and_logits():
    cfg = _cfg(bf16=True)
    model = Float16Module(cfg, _gpt(cfg, share_embeddings_and_output_weights=True))
    ids, pos = _batch()
    assert next(model.parameters()).dtype == torch.bfloat16
    loss = model(ids, pos, None, labels=ids)
    assert loss.dtype == torch.float32
    logits = model(ids, pos, None)
    assert logits.shape == (B, S, 64) and logits.dtype == torch.float32
    assert model.module.embedding.word_embeddings.weight.shared_embedding
