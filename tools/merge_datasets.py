"""Merge every `<name>.bin/.idx` pair in a directory (sorted by name) into one dataset.

    python tools/merge_datasets.py --input DIR --output-prefix PREFIX [--multimodal]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402


def _prefixes(directory):
    names = sorted(os.listdir(directory))
    stems = sorted({os.path.splitext(n)[0] for n in names if n.endswith((".bin", ".idx"))})
    for stem in stems:
        for ext in (".bin", ".idx"):
            if stem + ext not in names:
                raise SystemExit(f"error: {os.path.join(directory, stem)}: missing {ext} partner file")
    return [os.path.join(directory, s) for s in stems]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=str, required=True, help="directory of .bin/.idx pairs to merge")
    parser.add_argument("--output-prefix", type=str, required=True, help="prefix of the merged .bin/.idx")
    parser.add_argument("--multimodal", action="store_true", help="the datasets carry sequence modes")
    args = parser.parse_args(argv)
    prefixes = _prefixes(args.input)
    if not prefixes:
        raise SystemExit(f"error: --input {args.input}: no .bin/.idx pairs found")
    dtype = IndexedDataset(prefixes[0], multimodal=args.multimodal).index.dtype
    builder = IndexedDatasetBuilder(args.output_prefix + ".bin", dtype=dtype, multimodal=args.multimodal)
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(args.output_prefix + ".idx")
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}")


if __name__ == "__main__":
    main()
