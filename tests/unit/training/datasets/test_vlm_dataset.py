"""The image-text data path: JSONL captions and conversations -> tokens with one image token per image,
answer-only loss masks, tiles; bad input named in one line (or skipped); Energon round trip."""
import json
import os

import pytest
import torch

from megatron.training.datasets.image_processing import process_image, tile_grid
from megatron.training.datasets.vlm_data import data_format, energon_split_parts
from megatron.training.datasets.vlm_dataset import BadSample, ImageTextJsonlDataset, VLMDataConfig, collate_vlm
from megatron.training.tokenizer.bpe_tokenizers import _NullTokenizer
from tests.fixtures.vlm_data import IMAGE_TOKEN, VOCAB, write_image_text_set

TOK = _NullTokenizer(VOCAB)


def _config(**kw):
    return VLMDataConfig(**{**dict(seq_length=16, img_h=8, img_w=8, image_token_index=IMAGE_TOKEN), **kw})


def test_caption_and_conversation_samples(tmp_path):
    path = write_image_text_set(str(tmp_path), n=4)
    ds = ImageTextJsonlDataset(path, TOK, _config())
    cap = ds[0]
    assert cap["tokens"][0] == IMAGE_TOKEN and cap["images"].shape == (1, 3, 8, 8)
    # Loss on the caption's 6 tokens and the end-of-document, predicted from the positions before them.
    assert cap["loss_mask"][:7].tolist() == [1.0] * 7 and cap["loss_mask"][7:].sum() == 0
    assert torch.equal(cap["labels"][:6], cap["tokens"][1:7])
    conv = ds[3]
    assert (conv["tokens"] == IMAGE_TOKEN).sum() == 2 and conv["num_image_tiles"].tolist() == [1, 1]
    assert conv["loss_mask"][:3].sum() == 0  # the question is not learned
    batch = collate_vlm([cap, conv])
    assert batch["images"].shape[0] == 3 and batch["tokens"].shape == (2, 16)


def test_tiling_keeps_the_aspect_ratio_and_adds_a_thumbnail():
    from PIL import Image
    assert tile_grid(64, 32, 4) == (2, 1) and tile_grid(32, 32, 4) == (2, 2)
    image = Image.new("RGB", (64, 32), (255, 0, 0))
    tiles = process_image(image, 16, 16, use_tiling=True, max_num_tiles=4, use_thumbnail=True)
    assert tiles.shape == (3, 3, 16, 16)
    red = (1.0 - 0.48145466) / 0.26862954
    torch.testing.assert_close(tiles[:, 0], torch.full((3, 16, 16), red))


def test_text_cut_drops_the_images_it_cut_off(tmp_path):
    path = write_image_text_set(str(tmp_path), n=4)
    ds = ImageTextJsonlDataset(path, TOK, _config(seq_length=2))
    s = ds[3]  # "<image> 40 <image> 41 ..." cut to 2 tokens keeps the first image only
    assert (s["tokens"] == IMAGE_TOKEN).sum() == 1 and s["images"].shape[0] == 1


def test_bad_samples_name_file_and_line_or_are_skipped(tmp_path, caplog):
    extra = [{"image": "broken.png", "caption": "1 2"},
             {"image": "img0.png", "conversations": [{"from": "human", "value": "7 8"},
                                                    {"from": "gpt", "value": "3"}]},
             "{not json"]
    path = write_image_text_set(str(tmp_path), n=2, extra=extra)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    ds = ImageTextJsonlDataset(path, TOK, _config())
    for index, what in ((2, "broken.png cannot be read"), (3, "0 <image> tags for 1 image"), (4, "not valid JSON")):
        with pytest.raises(BadSample, match=f"train.jsonl:{index + 1}: .*{what}"):
            ds[index]
    skipping = ImageTextJsonlDataset(path, TOK, _config(skip_bad_samples=True))
    assert torch.equal(skipping[2]["tokens"], ds[0]["tokens"])  # wrapped around to the next good sample
    assert "train.jsonl:3" in caplog.text


def test_folder_without_energon_metadata_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="no Energon metadata"):
        data_format(str(tmp_path))
    assert data_format(str(tmp_path / "x.jsonl")) == "jsonl"


def test_prepare_energon_and_read_it_back(tmp_path):
    pytest.importorskip("megatron.energon")
    from tools.prepare_vlm_energon import prepare
    path = write_image_text_set(str(tmp_path / "src"), n=8, extra=[{"image": "missing.png", "caption": "1"}])
    out = str(tmp_path / "energon")
    with pytest.raises(BadSample, match="train.jsonl:9: image .*missing.png cannot be read"):
        prepare(path, out, (0.75, 0.25, 0.0), samples_per_shard=3)
    assert not os.path.exists(out)  # nothing half-written
    assert prepare(path, out, (0.75, 0.25, 0.0), samples_per_shard=3, skip_bad_samples=True) == 8
    assert data_format(out) == "energon" and energon_split_parts(out) == {"train", "val"}
    from megatron.core import parallel_state  # noqa: F401  (DP rank 0 of 1 without model parallelism)
    from megatron.training.datasets.vlm_energon import energon_loader
    loader = energon_loader(out, "train", TOK, _config(), micro_batch_size=2, num_workers=0)
    batch = next(iter(loader))
    assert batch["tokens"].shape == (2, 16)
    assert batch["images"].shape[0] == int((batch["tokens"] == IMAGE_TOKEN).sum())
    record = json.loads((tmp_path / "src" / "train.jsonl").read_text().splitlines()[0])
    assert record["image"] == "img0.png"
