"""Inputs checked before anything is built: --split, --data-path blends and weights, and every file or
directory a flag names (dataset .bin/.idx pairs with their sizes, tokenizer files, --load, --save).

Each failure is one line naming the flag, the value or file, and the fix."""
import os
import re

from megatron.core.datasets.indexed_dataset import check_dataset_files
from megatron.core.errors import InputError
from megatron.training.checkpointing.paths import get_checkpoint_tracker_filename

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def validate_inputs(args, require):
    """``require(condition, message)`` raises ArgumentError; called at the end of validate_args."""
    if args.split is not None:
        args.split = unquote_split(args.split)
        check_split(args.split, require)
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        blend = getattr(args, flag[2:].replace("-", "_"))
        if blend and not args.mock_data and not getattr(args, "sft", False) and not reads_image_text_data(args):
            # --sft: its files are checked in validation; pretrain_vlm.py reads image-text data, not .bin/.idx
            for prefix in blend_prefixes_checked(flag, blend, require):
                _check_dataset(flag, prefix, require)
    _check_tokenizer_files(args, require)
    _check_load(args, require)
    _check_save(args, require)


def reads_image_text_data(args) -> bool:
    """pretrain_vlm.py's --data-path is a JSONL of image-text samples or an Energon folder, and
    pretrain_vision_classify.py's image folders (their own loaders check them), not .bin/.idx prefixes;
    their parsers define --skip-bad-samples."""
    return hasattr(args, "skip_bad_samples")


def unquote_split(split):
    """'99,1,0' with its shell quotes kept -> 99,1,0. Megatron's llama example passes
    `"--split '99,1,0'"` in a bash array expanded unquoted: word splitting keeps the quote characters,
    and Megatron's parser reads only the numbers, so such a value must be accepted here too."""
    split = split.strip()
    if len(split) >= 2 and split[0] == split[-1] and split[0] in "'\"":
        return split[1:-1]
    return split


def check_split(split, require):
    """Megatron's --split: up to three non-negative proportions separated by ',' or '/', not all zero."""
    parts = [p.strip() for p in re.split(r"[,/]", split)]
    hint = "e.g. --split 969,30,1 (train,valid,test proportions)"
    require(1 <= len(parts) <= 3 and all(_NUMBER.match(p) for p in parts),
            f"--split '{split}': expected up to 3 numbers separated by ',' or '/', {hint}")
    values = [float(p) for p in parts]
    require(all(v >= 0 for v in values), f"--split '{split}': proportions must be >= 0, {hint}")
    require(sum(values) > 0, f"--split '{split}': proportions are all zero, {hint}")


def blend_prefixes_checked(flag, blend, require):
    """Prefixes of 'p1 [p2 ...]' or 'w1 p1 w2 p2 ...'; a list that starts with a number is weighted."""
    if len(blend) == 1 or not _NUMBER.match(blend[0]):
        for p in blend:
            require(not _NUMBER.match(p), f"{flag}: '{p}' looks like a weight in a list of prefixes; pass "
                                          "weights before every prefix (w1 p1 w2 p2 ...) or none")
        return list(blend)
    require(len(blend) % 2 == 0, f"{flag}: {len(blend)} values; a weighted blend alternates weight and "
                                 "prefix (w1 p1 w2 p2 ...)")
    weights = blend[0::2]
    for i, w in enumerate(weights):
        require(_NUMBER.match(w), f"{flag}: weight '{w}' (value {2 * i + 1}) is not a number; a weighted "
                                  "blend alternates weight and prefix (w1 p1 w2 p2 ...)")
        require(float(w) >= 0, f"{flag}: weight {w} of {blend[2 * i + 1]} is negative; weights must be >= 0")
    require(sum(float(w) for w in weights) > 0, f"{flag}: every weight is zero")
    return list(blend[1::2])


def _check_dataset(flag, prefix, require):
    try:
        check_dataset_files(prefix)
    except InputError as e:
        require(False, f"{flag}: {e}")


def _check_tokenizer_files(args, require):
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        path = getattr(args, name, None)
        if path is None or not os.path.exists(path):
            continue  # required-ness and existence are checked with the tokenizer type; hub ids are not paths
        flag = "--" + name.replace("_", "-")
        require(os.access(path, os.R_OK), f"{flag}: {path} is not readable (permissions)")
        if name != "tokenizer_model":
            require(os.path.isfile(path), f"{flag}: {path} is a directory; pass the file")
            require(os.path.getsize(path) > 0, f"{flag}: {path} is empty")


def _check_load(args, require):
    load = args.load
    if load is None:
        return
    if not os.path.exists(load):
        require(not args.exit_on_missing_checkpoint,
                f"--load: {load} does not exist (--exit-on-missing-checkpoint)")
        return  # Megatron starts from scratch (a first run with --load and --save on one directory)
    require(os.path.isdir(load), f"--load: {load} is a file; pass the checkpoint directory")
    require(os.access(load, os.R_OK | os.X_OK), f"--load: {load} is not readable (permissions)")
    tracker = get_checkpoint_tracker_filename(load)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        require(text == "release" or text.isdigit(),
                f"--load: {tracker} holds {text[:40]!r}, not an iteration number or 'release'; fix or delete it")
        if text.isdigit():
            it_dir = os.path.join(load, f"iter_{int(text):07d}")
            require(os.path.isdir(it_dir), f"--load: {tracker} names iteration {int(text)} but {it_dir} is "
                                           "missing; point the tracker at a saved iteration")


def _check_save(args, require):
    save = args.save
    if save is None:
        return
    existing = save
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing.rstrip(os.sep)) or "."
    require(os.path.isdir(existing), f"--save: {existing} is a file, so {save} cannot be a directory")
    require(os.access(existing, os.W_OK | os.X_OK), f"--save: {existing} is not writable")
