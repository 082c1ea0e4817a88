"""Float16Module: bf16 parameters, fp32 losses and logits, tied embeddings."""
import torch

from megatron.core.transformer.module import Float16Module
from tests.fixtures.tiny_gpt import cpu_reference_config as _cfg
from tests.fixtures.tiny_gpt import short_batch as _batch
from tests.fixtures.tiny_gpt import short_gpt as _gpt

S, B = 6, 2


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
