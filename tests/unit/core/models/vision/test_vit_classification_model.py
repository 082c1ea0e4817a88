"""VitClassificationModel: logits shape, Megatron's legacy head (tanh MLP, output bias -10), parameter names,
the class token is what is classified, and one-line refusals."""
import pytest
import torch

from megatron.core.models.vision.vit_classification_model import HEAD_BIAS_INIT, VitClassificationModel
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig


def config(**overrides):
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                  use_cpu_initialization=True, add_qkv_bias=True)
    fields.update(overrides)
    return TransformerConfig(**fields)


def test_logits_names_and_head(tmp_path):
    model = VitClassificationModel(config(), get_vit_layer_with_local_spec(), 7, img_h=16, img_w=8, patch_dim=4)
    logits = model(torch.randn(3, 3, 16, 8))
    assert logits.shape == (3, 7)
    names = {n for n, _ in model.named_parameters()}
    assert {"backbone.conv1.weight", "backbone.class_token", "backbone.position_embeddings.weight",
            "backbone.decoder.layers.1.self_attention.linear_qkv.weight", "final_layernorm.weight",
            "head.dense_in.weight", "head.dense_out.bias"} <= names
    assert torch.all(model.head.dense_out.bias == HEAD_BIAS_INIT)
    assert model.head.dense_in.weight.std() > 0


def test_classifies_the_class_token():
    """Changing the input changes the logits only through the class token's features."""
    model = VitClassificationModel(config(), get_vit_layer_with_local_spec(), 4, img_h=8, img_w=8, patch_dim=4).eval()
    x = torch.randn(2, 3, 8, 8)
    features = model.backbone(x)
    ref = model.head(model.final_layernorm(features[:, 0]))
    torch.testing.assert_close(model(x), ref)


def test_refusals():
    with pytest.raises(ValueError, match="--num-classes 0 must be >= 1"):
        VitClassificationModel(config(), get_vit_layer_with_local_spec(), 0, img_h=8, img_w=8, patch_dim=4)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 1"):
        VitClassificationModel(config(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32),
                               get_vit_layer_with_local_spec(), 3, img_h=8, img_w=8, patch_dim=4)
