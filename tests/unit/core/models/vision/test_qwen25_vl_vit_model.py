"""Qwen25VLVisionModel's pieces against transformers' vision helpers (window index and cumulative window
lengths, 2-D rotary positions) on grids that do and do not fill whole windows, and its one-line checks.
(Full-model logits against transformers: tests/functional/test_hf_conversion_qwen2_5_vl.py.)"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.vision.qwen25_vl_vit_model import Qwen25VLVisionModel, vision_rotary_freqs, window_index
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

vision_utils = pytest.importorskip("transformers.vision_utils")
GRIDS = torch.tensor([[1, 12, 8], [1, 4, 6], [2, 6, 10]])  # (t, h, w) in patches
PATCH, MERGE, WINDOW = 4, 2, 16


def test_window_index_matches_transformers():
    order, lens = window_index(GRIDS, MERGE, WINDOW, PATCH)
    want_order, want_cu = vision_utils.get_vision_window_index(GRIDS, MERGE, WINDOW, PATCH)
    assert torch.equal(order, want_order)
    assert torch.equal(torch.cat([torch.zeros(1, dtype=lens.dtype), lens.cumsum(0)]).int(), want_cu)


def test_rotary_positions_match_transformers():
    head_dim, theta = 16, 10000.0
    pos = vision_utils.get_vision_position_ids(GRIDS, MERGE)  # [N, 2]: (row, column) in patch order
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)))
    freqs = pos[..., None].float() * inv_freq  # [N, 2, d/4], transformers' Qwen2_5_VLVisionRotaryEmbedding
    half = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    assert torch.equal(vision_rotary_freqs(GRIDS, MERGE, head_dim, theta), torch.cat([half, half], dim=-1))


def _vit(**kw):
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=True, add_qkv_bias=True,
                            normalization="RMSNorm", layernorm_epsilon=1e-6, hidden_dropout=0.0,
                            attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False)
    model_parallel_cuda_manual_seed(0)
    return Qwen25VLVisionModel(cfg, get_vit_layer_with_local_spec(), patch_dim=PATCH, window_size=WINDOW, **kw)


def test_shapes_names_and_errors():
    vit = _vit(full_attention_layers=[1])
    assert vit.conv1.weight.shape == (32, 3, 2, PATCH, PATCH)
    assert "decoder.final_layernorm.weight" in vit.state_dict()
    grid = torch.tensor([[1, 4, 6]])
    out = vit(torch.randn(24, vit.patch_size_flat), grid)
    assert out.shape == (6, 32 * MERGE * MERGE)
    with pytest.raises(ValueError, match="do not match grid_thw"):
        vit(torch.randn(20, vit.patch_size_flat), grid)
    with pytest.raises(ValueError, match="not multiples of the spatial merge size"):
        vit(torch.randn(15, vit.patch_size_flat), torch.tensor([[1, 3, 5]]))
    with pytest.raises(ValueError, match="outside the 2 ViT layers"):
        _vit(full_attention_layers=[2])


def test_images_do_not_see_each_other():
    """Two images in one call give each image's features alone (the masks keep them apart)."""
    vit = _vit(full_attention_layers=[0]).eval()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(96, vit.patch_size_flat, generator=g), torch.randn(24, vit.patch_size_flat, generator=g)
    with torch.no_grad():
        both = vit(torch.cat([a, b]), GRIDS[:2])
        alone = torch.cat([vit(a, GRIDS[:1]), vit(b, GRIDS[1:2])])
    torch.testing.assert_close(both, alone, rtol=1e-5, atol=1e-6)
