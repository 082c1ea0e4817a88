"""Hugging Face Qwen2.5-VL in and out, proven by logits: a tiny random Qwen2_5_VLForConditionalGeneration
(fp32, CPU; a ViT with window and full-attention layers, the patch merger, a Qwen2 decoder with mRoPE) is
imported at TP=1 and TP=2 x PP=2, loaded by pretrain_vlm.py's model provider (--use-checkpoint-args) and
run on two samples holding three images of different sizes; our logits equal transformers'. Export writes
the imported tensors back bit for bit, and transformers loads the export to the same logits.
"""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from tests.fixtures.hf_checks import max_rel_err, randomize_vectors, safetensors_in, vlm_logits
from tests.parallel.dist_utils import run_distributed  # noqa: E402

VOCAB, IMAGE, START, END = 128, 120, 122, 123
PATCH, TEMPORAL, MERGE = 4, 2, 2
GRIDS = [(1, 12, 8), (1, 4, 6), (1, 8, 4)]  # (t, h, w) in patches; sample 0 has the first, sample 1 the others
# fp32 on CPU with the same operations as transformers: summation order differs under TP/PP (~1e-7).
RTOL = 1e-5


def _hf_config():
    from transformers import Qwen2_5_VLConfig
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, in_channels=3, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, window_size=16, out_hidden_size=64,
                  fullatt_block_indexes=[1])  # windows of 2 x 2 merge blocks (16 px); layer 1 sees whole images
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE, video_token_id=121,
                            vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=False)


def _image_tokens(grid):
    t, h, w = grid
    return [START] + [IMAGE] * (t * h * w // MERGE ** 2) + [END]


def _inputs():
    """(input ids [2, s] with the image-pad tokens expanded as the processor does, patches, grid_thw)."""
    g = torch.Generator().manual_seed(0)

    def text(n):
        return torch.randint(0, 100, (n,), generator=g).tolist()
    row0 = text(3) + _image_tokens(GRIDS[0]) + text(5)
    row1 = text(2) + _image_tokens(GRIDS[1]) + text(3) + _image_tokens(GRIDS[2])
    row1 += text(len(row0) - len(row1))
    grid = torch.tensor(GRIDS)
    patches = torch.randn(int(grid.prod(-1).sum()), 3 * TEMPORAL * PATCH * PATCH, generator=g)
    return torch.tensor([row0, row1]), patches, grid


def _hf_logits(model, ids, patches, grid):
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=patches, image_grid_thw=grid,
                     mm_token_type_ids=(ids == IMAGE).int()).logits


def _build_hf(path):
    from transformers import Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(_hf_config()).eval()
    randomize_vectors(model, norm_markers=("norm", "ln_q"))
    model.save_pretrained(path)
    return model


def our_logits(phases, ids, patches, grid):
    """For each (tp, pp, checkpoint): full-vocab logits [b, s, V] on the last stage's TP rank 0, else None."""
    return vlm_logits(phases, lambda model, x: model(patches, x, None, None, image_grid_thw=grid)[0], ids,
                      ids.shape[1], VOCAB)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from megatron.training.checkpointing.hf import export_hf_checkpoint, import_hf_checkpoint
    root = tmp_path_factory.mktemp("qwen2_5_vl")
    src = str(root / "hf")
    ids, patches, grid = _inputs()
    hf = _build_hf(src)
    ref = _hf_logits(hf, ids, patches, grid)
    with torch.no_grad():  # without mm_token_type_ids transformers falls back to 1-D positions
        plain = hf(input_ids=ids, pixel_values=patches, image_grid_thw=grid).logits
    import_hf_checkpoint(src, str(root / "tp1"))
    import_hf_checkpoint(src, str(root / "tp2pp2"), tp=2, pp=2)
    ranks = run_distributed(our_logits, 4, [(1, 1, str(root / "tp1")), (2, 2, str(root / "tp2pp2"))], ids, patches,
                            grid, timeout=600)
    logits = [next(r[i] for r in ranks if r[i] is not None) for i in range(2)]
    export_hf_checkpoint(str(root / "tp2pp2"), str(root / "back"))
    return dict(root=root, src=src, ref=ref, plain=plain, tp1=logits[0], tp2pp2=logits[1], ids=ids, patches=patches,
                grid=grid)


def test_logits_match_transformers(world):
    assert max_rel_err(world["plain"], world["ref"]) > 1e-3  # the 3-D image positions matter in this test
    assert world["tp1"].shape == world["ref"].shape
    assert max_rel_err(world["tp1"], world["ref"]) <= RTOL
    assert max_rel_err(world["tp2pp2"], world["ref"]) <= RTOL


def test_flags_written(world):
    flags = open(os.path.join(world["root"] / "tp1", "model_args.sh")).read()
    for flag in ("--vision-model-type qwen2.5_vit", "--position-embedding-type mrope", "--mrope-section 2 3 3",
                 "--vision-full-attention-layers 1", "--vision-window-size 16", "--spatial-merge-size 2",
                 "--encoder-num-layers 3", "--vision-projection-ffn-hidden-size 128", f"--image-token-index {IMAGE}",
                 "--add-qkv-bias", "--swiglu"):
        assert flag in flags, flag


def test_export_round_trip_and_transformers_loads_it(world):
    from transformers import Qwen2_5_VLForConditionalGeneration
    orig, back = safetensors_in(world["src"]), safetensors_in(str(world["root"] / "back"))
    assert sorted(orig) == sorted(back)
    for k in orig:
        assert torch.equal(orig[k], back[k]), k
    cfg = json.load(open(os.path.join(world["root"] / "back", "config.json")))
    assert cfg["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert cfg["vision_config"]["fullatt_block_indexes"] == [1]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(world["root"] / "back")).eval()
    assert max_rel_err(_hf_logits(model, world["ids"], world["patches"], world["grid"]), world["ref"]) <= RTOL


def test_rope_index_matches_transformers(world):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megatron.core.models.multimodal.qwen25_vl_rope_index import get_rope_index
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(world["src"])
    ids, grid = world["ids"], world["grid"]
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # padding is skipped
    want, want_delta = model.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=grid, attention_mask=mask)
    got, delta = get_rope_index(ids, grid, IMAGE, MERGE, attention_mask=mask)
    assert torch.equal(got, want) and torch.equal(delta, want_delta)


def test_unsupported_configs_fail_in_one_line():
    from megatron.core.hf import UnsupportedConfig, family_for_config

    def config():
        return dict(_hf_config().to_dict(), architectures=["Qwen2_5_VLForConditionalGeneration"])
    cfg = config()
    fam = family_for_config(cfg)
    cfg["vision_config"]["hidden_act"] = "gelu"
    with pytest.raises(UnsupportedConfig, match="vision hidden_act 'gelu'"):
        fam.config_to_flags(cfg)
    cfg = config()
    cfg["vision_config"]["out_hidden_size"] = 32
    with pytest.raises(UnsupportedConfig, match="out_hidden_size"):
        fam.rules(cfg)
