"""GPTModel: the same seed gives the same weights and load_state_dict restores them (the CUDA side is in
tests/gpu/test_gpt_model_gpu.py)."""
import torch

from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt

S, B = 6, 2


def _cfg(**kw):
    base = dict(num_query_groups=2, use_cpu_initialization=True)  # CPU references, even on a GPU host
    base.update(kw)
    return tiny_config(**base)


def _gpt(cfg, share_embeddings_and_output_weights=False, **kw):
    return tiny_gpt(cfg, max_sequence_length=S, share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                    **kw)


def test_same_seed_same_weights_and_load_state_dict():
    a, b = _gpt(_cfg()), _gpt(_cfg(seed=7))
    c = _gpt(_cfg())
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert torch.equal(pa[name], pc[name]) and not torch.equal(pa[name], pb[name])
    b.load_state_dict(a.state_dict())
    assert torch.equal(dict(b.named_parameters())[name], pa[name])
