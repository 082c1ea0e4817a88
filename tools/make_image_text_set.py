"""Write a synthetic image-text set (random PNG images + a JSONL of captions and two-image conversations)
for the example runs: no download needed. Captions are NullTokenizer ids (whitespace-separated integers)
that depend on the image's colour, so a model can learn them.

    python tools/make_image_text_set.py --output /tmp/vlm_tiny --samples 64 --size 32
"""
import argparse
import json
import os

import numpy as np
from PIL import Image


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="Folder to create (images + train.jsonl)")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--size", type=int, default=32, help="Image side in pixels (images vary around it)")
    p.add_argument("--vocab-size", type=int, default=512, help="Caption ids stay below vocab - 2")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    os.makedirs(a.output, exist_ok=True)
    with open(os.path.join(a.output, "train.jsonl"), "w") as f:
        for i in range(a.samples):
            colour = rng.integers(0, 256, 3)
            h, w = a.size + 8 * int(rng.integers(0, 3)), a.size + 8 * int(rng.integers(0, 3))
            pixels = np.clip(colour + rng.normal(0, 20, (h, w, 3)), 0, 255).astype("uint8")
            Image.fromarray(pixels).save(os.path.join(a.output, f"img{i}.png"))
            base = 1 + int(colour.sum()) % (a.vocab_size - 20)
            caption = " ".join(str(base + k) for k in range(8))
            if i % 4 == 3:  # a two-image conversation: loss on the answer only
                record = {"image": [f"img{i}.png", f"img{i - 1}.png"],
                          "conversations": [{"from": "human", "value": "<image> 3 <image> 4"},
                                            {"from": "gpt", "value": caption}]}
            else:
                record = {"image": f"img{i}.png", "caption": caption}
            f.write(json.dumps(record) + "\n")
    print(f"wrote {a.samples} samples to {a.output}/train.jsonl")


if __name__ == "__main__":
    main()
