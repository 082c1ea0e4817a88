"""Turn a folder of images + a JSONL of captions or conversations into a Megatron Energon dataset.

    python tools/prepare_vlm_energon.py --input data/train.jsonl --output data/energon --split 98,1,1

Writes WebDataset shards (each sample: its JSON record as ``json`` and its images as ``img0.png``,
``img1.jpg``, ...), a crude-dataset ``.nv-meta/dataset.yaml`` and Energon's split and index files (the
same files ``energon prepare`` writes), so that ``pretrain_vlm.py --data-path data/energon`` reads it with
Megatron Energon. The JSONL format is megatron/training/datasets/vlm_dataset.py's. Bad input (an
unreadable image, a malformed line, a sample whose text lacks its ``<image>`` tags) stops with one line
naming the file and line, or is skipped with --skip-bad-samples; the output appears only when complete.
"""
import argparse
import io
import json
import os
import shutil
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.datasets.vlm_data import ENERGON_META, ENERGON_MISSING  # noqa: E402
from megatron.training.datasets.vlm_dataset import IMAGE_TAG, BadSample, read_jsonl, record_images  # noqa: E402

DATASET_YAML = "__module__: megatron.energon\n__class__: CrudeWebdataset\nsubflavors: {}\n"


def _tag_count(record) -> int:
    if "conversations" in record:
        return sum(str(t.get("value", "")).count(IMAGE_TAG) for t in record["conversations"])
    caption = str(record.get("caption", record.get("text", "")))
    return caption.count(IMAGE_TAG) if IMAGE_TAG in caption else -1  # -1: the loader puts the images first


def _sample_files(record, where, root):
    """(record with images renamed img<i>.<ext>, {file name: bytes}) after checking each image decodes."""
    from PIL import Image  # lazy: only this tool and the vision data path need Pillow

    images = record_images(record)
    tags = _tag_count(record)
    if "conversations" not in record and "caption" not in record and "text" not in record:
        raise BadSample(f"{where}: a sample needs 'caption' (or 'text') or 'conversations'")
    if tags not in (-1, len(images)):
        raise BadSample(f"{where}: the text has {tags} {IMAGE_TAG} tags for {len(images)} image(s); put one "
                        f"{IMAGE_TAG} per image")
    files, names = {}, []
    for i, rel in enumerate(images):
        path = rel if os.path.isabs(rel) else os.path.join(root, rel)
        try:
            with open(path, "rb") as f:
                data = f.read()
            with Image.open(io.BytesIO(data)) as image:
                image.load()
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise BadSample(f"{where}: image {path} cannot be read ({str(e).splitlines()[0] or type(e).__name__})") \
                from None
        name = f"img{i}{os.path.splitext(rel)[1].lower() or '.png'}"
        files[name] = data
        names.append(name)
    record = dict(record)
    record.pop("images", None)
    record["image"] = names
    files["json"] = json.dumps(record).encode()
    return files


def _add(tar, key, files):
    for ext, data in files.items():
        info = tarfile.TarInfo(f"{key}.{ext}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def prepare(input_path, output, split=(98.0, 1.0, 1.0), samples_per_shard=1000, skip_bad_samples=False) -> int:
    """Write the dataset; returns the number of samples written."""
    try:
        from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory  # lazy: optional
    except ImportError:
        raise ImportError(ENERGON_MISSING) from None
    if os.path.exists(output):
        raise FileExistsError(f"--output {output} already exists; pass a new folder")
    lines = read_jsonl(input_path)
    root = os.path.dirname(os.path.abspath(input_path))
    staging = output.rstrip("/") + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(os.path.join(staging, ENERGON_META))
    shards, count, tar = [], 0, None
    try:
        for i, line in enumerate(lines):
            where = f"{input_path}:{i + 1}"
            try:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadSample(f"{where}: not valid JSON ({e.msg})") from None
                files = _sample_files(record, where, root)
            except BadSample as e:
                if not skip_bad_samples:
                    raise
                print(f"skipping {e}", file=sys.stderr)
                continue
            if count % samples_per_shard == 0:
                if tar is not None:
                    tar.close()
                shards.append(f"data-{len(shards):05d}.tar")
                tar = tarfile.open(os.path.join(staging, shards[-1]), "w")
            _add(tar, f"s{count:08d}", files)
            count += 1
    finally:
        if tar is not None:
            tar.close()
    if count == 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise ValueError(f"--input {input_path}: no usable sample")
    with open(os.path.join(staging, ENERGON_META, "dataset.yaml"), "w") as f:
        f.write(DATASET_YAML)
    parts = [(name, w) for name, w in zip(("train", "val", "test"), split) if w > 0]
    BaseWebdatasetFactory.prepare_dataset(staging, shards, split_parts_ratio=parts, workers=1,
                                          progress_fn=lambda it, n=0: it)
    os.rename(staging, output)
    return count


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="JSONL of image-text samples (images relative to its folder)")
    p.add_argument("--output", required=True, help="New folder for the Energon dataset")
    p.add_argument("--split", default="98,1,1", help="train,val,test proportions (Megatron's --split style)")
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--skip-bad-samples", action="store_true", help="skip bad samples instead of stopping")
    a = p.parse_args(argv)
    split = [float(x) for x in a.split.replace("/", ",").split(",")]
    try:
        n = prepare(a.input, a.output, (split + [0.0, 0.0])[:3], a.samples_per_shard, a.skip_bad_samples)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {n} samples to {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
