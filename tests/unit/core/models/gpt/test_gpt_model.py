"""GPTModel: the same seed gives the same weights and load_state_dict restores them (the CUDA side is in
tests/gpu/test_gpt_model_gpu.py)."""
import torch

from tests.fixtures.tiny_gpt import cpu_reference_config as _cfg
from tests.fixtures.tiny_gpt import short_gpt as _gpt

S, B = 6, 2


def test_same_seed_same_weights_and_load_state_dict():
    a, b = _gpt(_cfg()), _gpt(_cfg(seed=7))
    c = _gpt(_cfg())
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert torch.equal(pa[name], pc[name]) and not torch.equal(pa[name], pb[name])
    b.load_state_dict(a.state_dict())
    assert torch.equal(dict(b.named_parameters())[name], pa[name])
