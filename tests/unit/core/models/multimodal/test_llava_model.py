"""LLaVAModel on one process: image features land at the image-token places, labels and loss mask follow
the text, several images per sample and tiles, freezing, and the class-token switch."""
import pytest
import torch

from megatron.core.models.multimodal.llava_model import LLaVAModel
from tests.fixtures.tiny_vlm import IMAGE_TOKEN, IMG, IMG_SEQ, tiny_llava, vlm_batch


def _model(**kwargs):
    torch.manual_seed(0)
    return tiny_llava(**kwargs).eval()


def test_combined_sequence_layout():
    model = _model()
    ids = torch.tensor([[5, IMAGE_TOKEN, 6, 7, 8], [IMAGE_TOKEN, 1, IMAGE_TOKEN, 2, 3]])
    labels = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    images = torch.randn(4, 3, IMG, IMG)
    out, mask = model(images, ids, None, None, labels=labels, loss_mask=torch.ones(2, 5),
                      num_image_tiles=[1, 1, 2])
    # sample 0: 4 text + 1 image; sample 1: 3 text + 1 image + a 2-tile image
    assert out.shape == mask.shape == (2, 3 + 3 * IMG_SEQ)
    s = IMG_SEQ
    want0 = [0] + [0] * s + [1, 1, 1]  # token 5 precedes the image: masked
    assert mask[0, :len(want0)].tolist() == want0 and mask[0, len(want0):].sum() == 0
    want1 = [0] * s + [0] + [0] * 2 * s + [1, 1]
    assert mask[1].tolist() == want1
    assert out[0, 1 + s] > 0  # the cross-entropy of token 6 (first text after the image)


def test_image_features_reach_the_text_and_only_through_image_positions():
    model = _model()
    b = vlm_batch(0)
    logits, _ = model(b["images"], b["tokens"], None, None)
    logits2, _ = model(b["images"] + 1.0, b["tokens"], None, None)
    assert logits.shape[-1] == 64 and not torch.allclose(logits[:, -1], logits2[:, -1])
    # The positions before the first image token in a row see no image (causal decoder).
    first = int((b["tokens"][0] == IMAGE_TOKEN).nonzero()[0])
    torch.testing.assert_close(logits[0, :first], logits2[0, :first])


def test_text_only_batch():
    model = _model()
    ids = torch.randint(0, IMAGE_TOKEN, (2, 6))
    out, mask = model(torch.zeros(0, 3, IMG, IMG), ids, None, None, labels=ids, loss_mask=torch.ones(2, 6))
    assert out.shape == (2, 6) and mask.sum() == 12


def test_freeze_language_and_vision():
    model = _model()
    model.freeze(freeze_language_model=True, freeze_vision_model=True, freeze_vision_projection=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("vision_projection.") for n in trainable)
    b = vlm_batch(1)
    out, mask = model.train()(b["images"], b["tokens"], None, None, labels=b["labels"], loss_mask=b["loss_mask"])
    (out * mask).sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_image_token_count_must_match_images():
    model = _model()
    ids = torch.tensor([[1, IMAGE_TOKEN, 2]])
    with pytest.raises(ValueError, match="1 image tokens but 2 images"):
        model(torch.randn(2, 3, IMG, IMG), ids, None, None, num_image_tiles=[1, 1])


def test_encoder_and_decoder_draw_different_values():
    """``decoder.layers.0...`` exists in both parts; the encoder's name is prefixed, so its seed differs."""
    from tests.fixtures.tiny_vlm import language_config, vision_config
    language = language_config(hidden_size=24, num_query_groups=4, ffn_hidden_size=48)
    model = _model(language=language, vision=vision_config())
    assert isinstance(model, LLaVAModel)
    vit = model.vision_model.decoder.layers[0].self_attention.linear_proj.weight
    lm = model.language_model.decoder.layers[0].self_attention.linear_proj.weight
    assert vit.shape == lm.shape and not torch.equal(vit, lm)
