"""Print what a checkpoint holds: format, iteration, key args, and every tensor's key, shape and dtype.

    python tools/checkpoint/inspect_checkpoint.py SAVE_DIR [--iteration N] [--all-args]

SAVE_DIR is a --save directory (the tracker picks the iteration) or one iter_XXXXXXX directory.
CPU only; reads metadata and the small common state, never loads the torch_dist tensors.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SHOWN_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "seq_length", "max_position_embeddings", "padded_vocab_size", "tokenizer_type",
              "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
              "use_distributed_optimizer", "params_dtype", "consumed_train_samples", "train_iters")


def resolve(path, iteration=None):
    """(checkpoint directory, iteration) for a --save directory or an iter_* directory."""
    from megatron.training.checkpointing import paths
    if iteration is not None:
        return paths.get_checkpoint_name(path, iteration, return_base_dir=True), iteration
    tracker = paths.get_checkpoint_tracker_filename(path)
    if os.path.isfile(tracker):
        it, release = paths.read_metadata(tracker)
        return paths.get_checkpoint_name(path, it, release, return_base_dir=True), it
    name = os.path.basename(os.path.normpath(path))
    if name.startswith("iter_") and name[5:].isdigit():
        return path, int(name[5:])
    raise SystemExit(f"error: {path} has no {paths.TRACKER_FNAME} and is not an iter_XXXXXXX directory")


def _tensors(tree, prefix=""):
    import torch
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}{k}." if not torch.is_tensor(v) else f"{prefix}{k}")
    elif torch.is_tensor(tree):
        yield prefix, tuple(tree.shape), tree.dtype


def describe(checkpoint_dir):
    """(format, common state, [(key, shape, dtype)]) of one checkpoint directory."""
    import torch

    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import paths
    fmt = paths.detect_format(checkpoint_dir)
    if fmt == "torch_dist":
        common = dist_checkpointing.load_common_state_dict(checkpoint_dir)
        meta = dist_checkpointing.load_tensors_metadata(checkpoint_dir)
        return fmt, common, sorted((k, tuple(sh.global_shape), sh.dtype) for k, sh in meta.items())
    if fmt == "torch":
        rows, common = [], None
        for name in sorted(n for n in os.listdir(checkpoint_dir) if n.startswith("mp_rank_")):
            sd = torch.load(os.path.join(checkpoint_dir, name, paths.LEGACY_FNAME), map_location="cpu",
                            weights_only=False)
            common = common if common is not None else sd
            rows += [(f"{name}/{k}", s, d) for k, s, d in _tensors({k: v for k, v in sd.items() if k != "args"})]
        return fmt, common, rows
    raise SystemExit(f"error: {checkpoint_dir} holds no complete checkpoint (no metadata.json, no mp_rank_*)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", help="--save directory or iter_XXXXXXX directory")
    parser.add_argument("--iteration", type=int, default=None, help="Iteration to inspect (default: latest)")
    parser.add_argument("--all-args", action="store_true", help="Print every saved argument")
    opts = parser.parse_args(argv)
    checkpoint_dir, iteration = resolve(opts.path, opts.iteration)
    fmt, common, rows = describe(checkpoint_dir)
    print(f"checkpoint: {checkpoint_dir}")
    print(f"format: {fmt}")
    print(f"iteration: {common.get('iteration', iteration)}")
    print(f"checkpoint_version: {common.get('checkpoint_version')}")
    args = common.get("args")
    if args is not None:
        print("args:")
        names = sorted(vars(args)) if opts.all_args else [n for n in SHOWN_ARGS if hasattr(args, n)]
        for name in names:
            print(f"  {name} = {getattr(args, name)}")
    print(f"tensors: {len(rows)}")
    for key, shape, dtype in rows:
        print(f"  {key} {list(shape)} {str(dtype).replace('torch.', '')}")


if __name__ == "__main__":
    main()
