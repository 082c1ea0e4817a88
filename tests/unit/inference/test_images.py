"""Images with prompts (megatron/inference/images.py): tags assign images in order, a lone untagged prompt
takes them first, tokens get one image token per tag, and bad input is one line."""
import base64
import io

import pytest
import torch
from PIL import Image

from megatron.inference.images import (
    ImageConfig,
    assign_images,
    decode_base64,
    detokenize_with_images,
    image_tiles,
    tokenize_with_images,
)


class _Tokenizer:  # NullTokenizer's behaviour: ids are the whitespace-separated integers
    bos = 1

    def tokenize(self, text):
        return [int(x) for x in text.split()]

    def detokenize(self, ids):
        return " ".join(map(str, ids))


def _tiles(n):
    return torch.zeros(n, 3, 4, 4)


def test_assign_images():
    prompts, per = assign_images(["a <image>", "b", "<image> c <image>"], [_tiles(1), _tiles(2), _tiles(1)])
    assert per[1] is None and per[0].num_image_tiles == [1] and per[2].num_image_tiles == [2, 1]
    assert per[2].tiles.shape[0] == 3 and prompts[0] == "a <image>"
    prompts, per = assign_images(["describe"], [_tiles(1), _tiles(1)])
    assert prompts == ["<image><image>describe"] and per[0].num_image_tiles == [1, 1]
    with pytest.raises(ValueError, match="the prompts have 1 <image> tag"):
        assign_images(["<image>", "x"], [])


def test_tokens_with_images():
    tok = _Tokenizer()
    ids = tokenize_with_images(tok, "5 17 <image> 42<image>", 100, add_bos=True)
    assert ids == [1, 5, 17, 100, 42, 100]
    assert detokenize_with_images(tok, ids[1:], 100) == "5 17<image>42<image>"


def test_decoding_and_bad_input():
    buf = io.BytesIO()
    Image.new("RGB", (10, 6), (255, 0, 0)).save(buf, format="PNG")
    config = ImageConfig(img_h=8, img_w=8, image_token_index=100)
    data = decode_base64("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), "img")
    assert image_tiles(data, config, "img").shape == (1, 3, 8, 8)
    with pytest.raises(ValueError, match="img is not valid base64"):
        decode_base64("%%%", "img")
    with pytest.raises(ValueError, match="img cannot be read as an image"):
        image_tiles(b"not a png", config, "img")
