"""--embedding-init-method-std (Megatron's rule): the word and position embeddings draw from N(0, std) while the
other layers keep --init-method-std; without it the embeddings draw as the layers' init method does, so a model's
weights are those of a build before the flag existed."""
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import VOCAB, single_rank, tiny_config


def _model(**kw):
    single_rank()
    model_parallel_cuda_manual_seed(3)
    cfg = tiny_config(hidden_size=64, **kw)
    return cfg, GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, 64, position_embedding_type="learned_absolute")


def test_embedding_std_applies_to_the_embeddings_only():
    cfg, model = _model(embedding_init_method_std=1.0)
    emb = model.embedding
    for w in (emb.word_embeddings.weight, emb.position_embeddings.weight):
        assert 0.9 < w.float().std().item() < 1.1
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.float().std().item() < 0.03


def test_default_embedding_init_draws_like_the_layers_init_method():
    cfg, model = _model()
    assert cfg.embedding_init_method_std == cfg.init_method_std
    draws = []
    for fn in (model.embedding.word_embeddings.weight.init_fn, cfg.init_method):
        torch.manual_seed(0)
        draws.append(fn(torch.empty(64, 64)))
    assert torch.equal(*draws)
