"""Hugging Face LLaVA (CLIP ViT + Llama) in and out, proven by logits: a tiny random
LlavaForConditionalGeneration (fp32, CPU) is imported at TP=1 and TP=2 x PP=2, loaded by pretrain_vlm.py's
model provider (--use-checkpoint-args) and run on two samples of two images each; our logits over the
combined sequence equal transformers' (its text holds image_seq_length image tokens per image, ours one).
Export writes the imported tensors back bit for bit, and transformers loads the export to the same logits.
"""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from tests.fixtures.hf_checks import max_rel_err, randomize_vectors, safetensors_in, vlm_logits
from tests.parallel.dist_utils import run_distributed  # noqa: E402

VOCAB, IMAGE_TOKEN, IMG, PATCH = 120, 119, 8, 4
PATCHES = (IMG // PATCH) ** 2
# fp32 on CPU with the same operations as transformers: summation order differs under TP/PP (~1e-7).
RTOL = 1e-5


def _hf_config():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    vision = CLIPVisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                              image_size=IMG, patch_size=PATCH, projection_dim=16)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                       vision_feature_layer=-2, vision_feature_select_strategy="default", image_seq_length=PATCHES)


def _inputs():
    """Two samples with two images each: (our ids with one image token per image, HF's expanded ids, images)."""
    g = torch.Generator().manual_seed(0)
    ours = torch.randint(0, IMAGE_TOKEN, (2, 10), generator=g)
    ours[0, [1, 6]] = IMAGE_TOKEN
    ours[1, [0, 3]] = IMAGE_TOKEN
    hf = torch.stack([torch.cat([torch.full((PATCHES,), IMAGE_TOKEN) if t == IMAGE_TOKEN else t.view(1) for t in row])
                      for row in ours])
    return ours, hf, torch.randn(4, 3, IMG, IMG, generator=g)


def _hf_logits(model, hf_ids, images):
    with torch.no_grad():
        return model(input_ids=hf_ids, pixel_values=images).logits


def _build_hf(path):
    from transformers import LlavaForConditionalGeneration
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(_hf_config()).eval()
    randomize_vectors(model, norm_markers=("norm",))
    model.save_pretrained(path)
    return model


def our_logits(phases, ours, images, seq):
    """For each (tp, pp, checkpoint): full-vocab logits [b, S, V] on the last stage's TP rank 0, else None."""
    return vlm_logits(phases, lambda model, ids: model(images, ids, None, None)[0], ours, seq, VOCAB,
                      extra_argv=["--dataloader-seq-length", "10"])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from megatron.training.checkpointing.hf import export_hf_checkpoint, import_hf_checkpoint
    root = tmp_path_factory.mktemp("llava")
    src = str(root / "hf")
    ours, hf_ids, images = _inputs()
    ref = _hf_logits(_build_hf(src), hf_ids, images)
    import_hf_checkpoint(src, str(root / "tp1"))
    import_hf_checkpoint(src, str(root / "tp2pp2"), tp=2, pp=2)
    seq = hf_ids.shape[1]
    ranks = run_distributed(our_logits, 4, [(1, 1, str(root / "tp1")), (2, 2, str(root / "tp2pp2"))], ours, images,
                            seq, timeout=600)
    logits = [next(r[i] for r in ranks if r[i] is not None) for i in range(2)]
    export_hf_checkpoint(str(root / "tp2pp2"), str(root / "back"))
    return dict(root=root, src=src, ref=ref, tp1=logits[0], tp2pp2=logits[1], hf_ids=hf_ids, images=images)


def test_logits_match_transformers(world):
    assert world["tp1"].shape == world["ref"].shape
    assert max_rel_err(world["tp1"], world["ref"]) <= RTOL
    assert max_rel_err(world["tp2pp2"], world["ref"]) <= RTOL


def test_flags_written(world):
    flags = open(os.path.join(world["root"] / "tp1", "model_args.sh")).read()
    for flag in ("--encoder-num-layers 2", "--vision-hidden-size 24", "--patch-dim 4", "--img-h 8",
                 f"--image-token-index {IMAGE_TOKEN}", "--disable-vision-class-token", "--swiglu"):
        assert flag in flags, flag


def test_export_round_trip_and_transformers_loads_it(world):
    from transformers import LlavaForConditionalGeneration
    orig, back = safetensors_in(world["src"]), safetensors_in(str(world["root"] / "back"))
    # The third ViT layer (never read: vision_feature_layer -2) is not part of our model.
    orig = {k: v for k, v in orig.items() if "encoder.layers.2." not in k and "post_layernorm" not in k}
    back = {k: v for k, v in back.items() if "post_layernorm" not in k}
    assert sorted(orig) == sorted(back)
    for k in orig:
        assert torch.equal(orig[k], back[k]), k
    cfg = json.load(open(os.path.join(world["root"] / "back", "config.json")))
    assert cfg["vision_feature_layer"] == -1 and cfg["vision_config"]["num_hidden_layers"] == 2
    model = LlavaForConditionalGeneration.from_pretrained(str(world["root"] / "back")).eval()
    assert max_rel_err(_hf_logits(model, world["hf_ids"], world["images"]), world["ref"]) <= RTOL


def test_unsupported_configs_fail_in_one_line():
    from megatron.core.hf import UnsupportedConfig, family_for_config

    def config():
        return dict(_hf_config().to_dict(), architectures=["LlavaForConditionalGeneration"])
    cfg = config()
    fam = family_for_config(cfg)
    cfg["vision_config"]["hidden_act"] = "gelu"
    with pytest.raises(UnsupportedConfig, match="vision hidden_act 'gelu'"):
        fam.config_to_flags(cfg)
    cfg = config()
    cfg["vision_feature_layer"] = [-2, -5]
    with pytest.raises(UnsupportedConfig, match="several layers"):
        fam.rules(cfg)
