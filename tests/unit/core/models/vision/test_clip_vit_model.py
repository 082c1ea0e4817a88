"""CLIPViTModel: shapes and parameter layout, SigLIP without a class token, position interpolation (equal to
Hugging Face CLIP's ``interpolate_pos_encoding``), and the projector types."""
import pytest
import torch

from megatron.core.models.vision.clip_vit_model import CLIPViTModel, interpolate_position_embeddings
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import get_vision_projection_submodules, get_vit_layer_with_local_spec
from tests.fixtures.tiny_vlm import vision_config


def test_clip_shapes_and_names():
    vit = CLIPViTModel(vision_config(), get_vit_layer_with_local_spec(), patch_dim=4, img_h=16, img_w=12)
    assert vit.seq_length == 1 + 4 * 3
    out = vit(torch.randn(2, 3, 16, 12))
    assert out.shape == (2, 13, 24)
    names = dict(vit.named_parameters())
    assert names["class_token"].shape == (1, 1, 24)
    assert names["conv1.weight"].shape == (24, 3, 4, 4) and "conv1.bias" not in names
    assert names["position_embeddings.weight"].shape == (13, 24)
    assert "ln_pre.weight" in names and "decoder.layers.1.mlp.linear_fc2.weight" in names
    assert not any(n.startswith("decoder.final_layernorm") for n in names)


def test_siglip_has_no_class_token_and_a_post_norm():
    vit = CLIPViTModel(vision_config(), get_vit_layer_with_local_spec(), add_class_token=False, class_token_len=0,
                       patch_dim=4, img_h=8, img_w=8, model_subtype="siglip")
    names = dict(vit.named_parameters())
    assert "class_token" not in names and "conv1.bias" in names and "ln_post.weight" in names
    assert vit(torch.randn(1, 3, 8, 8)).shape == (1, 4, 24)
    with pytest.raises(ValueError, match="SigLIP has no class token"):
        CLIPViTModel(vision_config(), get_vit_layer_with_local_spec(), model_subtype="siglip", patch_dim=4,
                     img_h=8, img_w=8)


def test_attention_is_not_causal():
    """The last patch changes the first token's features (a causal mask would hide it)."""
    vit = CLIPViTModel(vision_config(), get_vit_layer_with_local_spec(), patch_dim=4, img_h=8, img_w=8)
    x = torch.randn(1, 3, 8, 8)
    y = x.clone()
    y[..., 4:, 4:] += 1.0
    assert not torch.allclose(vit(x)[:, 0], vit(y)[:, 0])


def test_interpolation_matches_hf_clip():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPVisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, image_size=8, patch_size=4)
    hf = transformers.models.clip.modeling_clip.CLIPVisionEmbeddings(cfg)
    table = hf.position_embedding.weight.detach()
    emb = torch.zeros(1, 1 + 16, 24)  # HF reads the new patch count from the embeddings
    want = hf.interpolate_pos_encoding(emb, 16, 16)[0]
    got = interpolate_position_embeddings(table, (2, 2), (4, 4), 1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert interpolate_position_embeddings(table, (2, 2), (2, 2), 1) is table


def test_other_image_size_runs_and_same_size_is_unchanged():
    vit = CLIPViTModel(vision_config(), get_vit_layer_with_local_spec(), patch_dim=4, img_h=8, img_w=8)
    assert vit(torch.randn(2, 3, 12, 16)).shape == (2, 1 + 12, 24)
    with pytest.raises(ValueError, match="multiple of the patch size"):
        vit(torch.randn(1, 3, 10, 8))


@pytest.mark.parametrize("kind", ["mlp", "affine"])
def test_projector(kind):
    cfg = vision_config(hidden_size=32, ffn_hidden_size=40)
    proj = MultimodalProjector(cfg, get_vision_projection_submodules(), kind, input_size=24)
    assert proj(torch.randn(5, 2, 24)).shape == (5, 2, 32)
    with pytest.raises(ValueError, match="projection type"):
        MultimodalProjector(cfg, get_vision_projection_submodules(), "conv", input_size=24)
