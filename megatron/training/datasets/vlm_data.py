"""pretrain_vlm.py's datasets: a JSONL of image-text samples (built in), or a Megatron Energon dataset.

Energon datasets are the WebDataset shards + ``.nv-meta`` folder that ``energon prepare`` (or
tools/prepare_vlm_energon.py) writes; each sample holds the JSON record and its image files. Energon's own
loader shards them over data-parallel ranks and workers, so the loader is handed to the training loop as
is (``--dataloader-type external``); the records are encoded by the same code as the JSONL path.
"""
import os
import re

from .vlm_dataset import ImageTextJsonlDataset, VLMDataConfig, read_jsonl

ENERGON_META = ".nv-meta"
ENERGON_MISSING = ("Megatron Energon datasets need the megatron-energon package: pip install megatron-energon "
                   "(or pass a JSONL file as --data-path)")


def data_config_from_args(args) -> VLMDataConfig:
    return VLMDataConfig(seq_length=args.dataloader_seq_length, img_h=args.img_h, img_w=args.img_w,
                         image_token_index=args.image_token_index, vision_model_type=args.vision_model_type,
                         use_tiling=args.use_tiling, max_num_tiles=args.max_num_tiles,
                         use_thumbnail=args.use_thumbnail, skip_bad_samples=args.skip_bad_samples)


def data_format(path: str, requested: str = "auto") -> str:
    """'energon' or 'jsonl' for --data-path ``path``; a folder without Energon metadata is one line."""
    is_energon = os.path.isdir(os.path.join(path, ENERGON_META))
    if requested == "energon" or (requested == "auto" and os.path.isdir(path)):
        if not is_energon:
            raise ValueError(f"--data-path {path}: no Energon metadata ({ENERGON_META}/); prepare the folder with "
                             "`energon prepare` or tools/prepare_vlm_energon.py, or pass a JSONL file")
        return "energon"
    return "jsonl"


def energon_split_parts(path: str) -> set:
    """The split parts (train / val / test) an Energon dataset's .nv-meta/split.yaml names."""
    parts, inside = set(), False
    with open(os.path.join(path, ENERGON_META, "split.yaml")) as f:
        for line in f:
            if not line.startswith(" ") and line.strip():
                inside = line.startswith("split_parts:")
            elif inside and re.match(r"^ {1,4}[A-Za-z_]+:", line):
                parts.add(line.strip().split(":")[0])
    return parts


def _split_sizes(n: int, split: str):
    weights = [float(x) for x in (split or "100,0,0").replace("/", ",").split(",")]
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(n * w / total)))
    bounds[-1] = n
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def build_vlm_datasets(args, tokenizer, num_samples):
    """(train, valid, test) for --data-path: JSONL lines split by --split, or Energon's train/val/test parts."""
    if not args.data_path:
        raise ValueError("pretrain_vlm.py needs --data-path: a JSONL of image-text samples or an Energon folder")
    path = args.data_path[0]
    config = data_config_from_args(args)
    if config.image_token_index == tokenizer.eod:
        raise ValueError(f"--image-token-index {config.image_token_index} is the tokenizer's end-of-document id; "
                         "pick an id the text never uses (e.g. a reserved special token)")
    if data_format(path, args.vlm_data_format) == "energon":
        parts = energon_split_parts(path)
        return tuple(_energon_loader(path, part, tokenizer, config, args) if n and part in parts else None
                     for part, n in zip(("train", "val", "test"), num_samples))
    lines = read_jsonl(path)
    out = []
    for (start, end), n in zip(_split_sizes(len(lines), args.split), num_samples):
        if end <= start or not n:
            out.append(None)
            continue
        ds = ImageTextJsonlDataset(path, tokenizer, config, num_samples=n)
        ds.lines = lines[start:end]
        ds.first_line = start
        out.append(ds)
    return tuple(out)


def _energon_loader(path, part, tokenizer, config, args):
    try:
        from .vlm_energon import energon_loader  # lazy: megatron-energon is an optional dependency
    except ImportError:
        raise ImportError(ENERGON_MISSING) from None
    return energon_loader(path, part, tokenizer, config, args.micro_batch_size, args.num_workers)
