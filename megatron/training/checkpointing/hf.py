"""Hugging Face checkpoints in and out of our checkpoints (the library behind tools/checkpoint/hf.py).

    import_hf_checkpoint(hf_dir, out_dir, tp=2, pp=2, fmt="torch_dist")   # then: --load out_dir
    export_hf_checkpoint(checkpoint_path, hf_out_dir)                      # then: from_pretrained(hf_out_dir)

Import writes ``iter_0000000`` + tracker, the args that rebuild the architecture (for
``--use-checkpoint-args``), ``model_args.sh`` with the same flags, the source ``hf_config.json`` and the
tokenizer files. torch_dist is written in this process, tensor by tensor from the safetensors shards
(any TP/PP layout reads it); the legacy torch format is then rewritten per rank on spawned gloo ranks.
"""
import json
import math
import os
import shlex
import shutil
import tempfile

from megatron.core.dist_checkpointing import load_tensors_metadata
from megatron.core.hf import FAMILIES, family_for_config
from megatron.core.hf.dist_io import read_global, save_global
from megatron.core.hf.safetensors_io import SafetensorsReader, ShardedSafetensorsWriter, read_config
from megatron.core.hf.state import hf_to_ours, ours_to_hf, shapes_from_flags
from megatron.training.arguments import parse_args, validate_args
from megatron.training.arguments.vision_args import add_vlm_args

from . import paths
from .args import read_checkpoint_args
from .convert import convert

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja")
HF_CONFIG_NAME = "hf_config.json"
# What bad input raises here; the command-line tools print it as one "error: ..." line.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, KeyError)
FLAGS_NAME = "model_args.sh"
# Families trained by another entry point than pretrain_gpt.py: the flags that entry point adds.
EXTRA_ARGS = {"llava": add_vlm_args, "qwen2_5_vl": add_vlm_args}


def _argv(flags):
    """[(flag, value)] -> argv; a value None is a switch, a list gives the flag's several values."""
    out = []
    for flag, value in flags:
        if isinstance(value, (list, tuple)):
            out += [flag] + [str(v) for v in value]
        else:
            out += [flag] if value is None else [flag, str(value)]
    return out


def _padded(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def _check_layout(flags, tp: int, pp: int, ep: int = 1) -> None:
    f = dict(flags)
    heads, layers = int(f["--num-attention-heads"]), int(f["--num-layers"])
    groups = int(f.get("--num-query-groups", heads))
    if heads % tp or groups % tp:
        raise ValueError(f"--tp {tp} must divide the attention heads ({heads}) and KV groups ({groups})")
    if layers % pp:
        raise ValueError(f"--pp {pp} must divide the number of layers ({layers})")
    experts = int(f.get("--num-experts") or 0)
    if ep > 1 and not experts:
        raise ValueError(f"--ep {ep} needs a mixture-of-experts model; this one is dense")
    if experts and experts % ep:
        raise ValueError(f"--ep {ep} must divide the number of experts ({experts})")
    moe_ffn = int(f.get("--moe-ffn-hidden-size") or 0)
    if experts and moe_ffn % tp:
        raise ValueError(f"--tp {tp} must divide the expert FFN size ({moe_ffn}; expert TP defaults to --tp)")


def _tokenizer_argv(hf_dir: str, out_dir: str, vocab: int):
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", os.path.abspath(out_dir)]
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab)]


def build_args(flags, tp, pp, fmt, out_dir, tokenizer_argv, vocab, padded, divisible_by, ep=1,
               extra_args_provider=None):
    """The full args namespace a training run with these flags would have (saved for --use-checkpoint-args)."""
    seq = min(int(dict(flags)["--max-position-embeddings"]), 4096)
    argv = _argv(flags) + tokenizer_argv + [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--expert-model-parallel-size", str(ep),
        "--make-vocab-size-divisible-by", str(divisible_by), "--seq-length", str(seq), "--micro-batch-size", "1",
        "--ckpt-format", fmt, "--no-save-optim", "--no-save-rng",
        "--train-iters", "1", "--lr", "0.0", "--mock-data"]
    args = parse_args(extra_args_provider, argv=argv)
    args.rank, args.world_size = 0, tp * pp * ep
    validate_args(args)
    args.vocab_size, args.padded_vocab_size = vocab, padded
    args.save = args.load = out_dir
    args.iteration = 0
    return args


def _write_sidecars(hf_dir, out_dir, cfg, flags, tokenizer_argv):
    os.makedirs(out_dir, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copy2(os.path.join(hf_dir, name), os.path.join(out_dir, name))
    with open(os.path.join(out_dir, HF_CONFIG_NAME), "w") as f:
        json.dump(cfg, f, indent=2)
    lines = ["# Megatron flags that rebuild the architecture converted from", f"#   {os.path.abspath(hf_dir)}",
             "# (or pass --use-checkpoint-args with --load to take them from the checkpoint)", "MODEL_ARGS=("]
    argv = _argv(flags) + tokenizer_argv
    i = 0
    while i < len(argv):
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):  # the flag's values
            j += 1
        lines.append("    " + " ".join(shlex.quote(a) for a in argv[i:j]))
        i = j
    lines.append(")")
    with open(os.path.join(out_dir, FLAGS_NAME), "w") as f:
        f.write("\n".join(lines) + "\n")


def import_hf_checkpoint(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, fmt: str = "torch_dist",
                         make_vocab_size_divisible_by: int = 128, ep: int = 1, moe_grouped_gemm: bool = False) -> str:
    """Convert a HF model directory into our checkpoint under ``out_dir``; returns the checkpoint dir.

    MoE models: ``ep`` is the recorded expert-parallel size (torch_dist loads under any); ``moe_grouped_gemm``
    writes GroupedMLP's stacked expert tensors (train with --moe-grouped-gemm) instead of SequentialMLP's."""
    if fmt not in ("torch_dist", "torch"):
        raise ValueError(f"format {fmt!r} is not supported; use torch_dist or torch")
    cfg = read_config(hf_dir)
    family = family_for_config(cfg)
    flags = family.config_to_flags(cfg)
    if moe_grouped_gemm:
        if "--num-experts" not in dict(flags):
            raise ValueError(f"--moe-grouped-gemm: {hf_dir} is a dense model (no experts)")
        flags.append(("--moe-grouped-gemm", None))
    if fmt == "torch" and ep > 1:
        raise ValueError(f"--ep {ep} with the torch format is not supported (its files are per layout); "
                         f"import as torch_dist, which loads under any --expert-model-parallel-size")
    _check_layout(flags, tp, pp, ep)
    vocab = int(cfg["vocab_size"] if "vocab_size" in cfg else cfg["text_config"]["vocab_size"])
    padded = _padded(vocab, make_vocab_size_divisible_by, tp)
    shapes = shapes_from_flags(flags, vocab, padded)
    reader = SafetensorsReader(hf_dir)
    tensors = hf_to_ours(family, cfg, shapes, reader, where=hf_dir)  # shapes checked before writing anything
    final = paths.get_checkpoint_name(out_dir, 0, return_base_dir=True)
    if os.path.exists(final):
        raise FileExistsError(f"{final} already exists; pass an empty output directory")
    tok = _tokenizer_argv(hf_dir, out_dir, vocab)
    args = build_args(flags, tp, pp, fmt, out_dir, tok, vocab, padded, make_vocab_size_divisible_by, ep,
                      EXTRA_ARGS.get(family.name))
    _write_sidecars(hf_dir, out_dir, cfg, flags, tok)
    common = {"args": args, "checkpoint_version": 3.0, "iteration": 0, "num_floating_point_operations_so_far": 0}
    if fmt == "torch_dist":
        staging = paths.staging_dir(final)
        shutil.rmtree(staging, ignore_errors=True)
        save_global(tensors, staging, common)
        paths.publish_dir(staging, final)
        paths.write_tracker(out_dir, 0)
    else:
        tmp = tempfile.mkdtemp(prefix="hf_import_", dir=os.path.dirname(os.path.abspath(out_dir)))
        try:
            save_global(tensors, paths.get_checkpoint_name(tmp, 0, return_base_dir=True), common)
            paths.write_tracker(tmp, 0)
            convert(tmp, out_dir, "torch", tp, pp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    reader.close()
    return final


def _infer_family(args):
    """The HF family of a checkpoint's saved args (getattr here: saves older than a flag lack it)."""
    if hasattr(args, "vision_model_type"):  # pretrain_vlm.py's flags
        return FAMILIES["qwen2_5_vl" if args.vision_model_type == "qwen2.5_vit" else "llava"]
    if getattr(args, "is_hybrid_model", False):
        layers = set((args.hybrid_layer_pattern or "").replace("|", ""))
        if "G" in layers or getattr(args, "attention_output_gate", False):
            return FAMILIES["qwen3_next"]
        return FAMILIES["mamba2" if layers == {"M"} else "nemotron_h"]
    if getattr(args, "multi_latent_attention", False):
        return FAMILIES["deepseek_v3"]
    if getattr(args, "num_experts", None):
        return FAMILIES["qwen3_moe" if args.qk_layernorm else "mixtral"]
    if args.normalization == "LayerNorm":
        return FAMILIES["gpt2"]
    if getattr(args, "window_size", None) is not None:
        return FAMILIES["mistral"]
    if args.qk_layernorm:
        return FAMILIES["qwen3"]
    return FAMILIES["qwen2"] if args.add_qkv_bias else FAMILIES["llama"]


def export_hf_checkpoint(checkpoint_path: str, out_dir: str, iteration=None, vocab_size=None,
                         family=None, max_shard_bytes: int = 5 * 2 ** 30) -> str:
    """Write ``out_dir`` (config.json, safetensors shards + index, tokenizer files) from our checkpoint."""
    args, iteration = read_checkpoint_args(checkpoint_path, iteration)
    src = paths.get_checkpoint_name(checkpoint_path, iteration, return_base_dir=True)
    if not os.path.isdir(src):
        src = paths.get_checkpoint_name(checkpoint_path, iteration, release=True, return_base_dir=True)
    tmp = None
    try:
        if paths.detect_format(src) == "torch":
            tmp = tempfile.mkdtemp(prefix="hf_export_", dir=os.path.dirname(os.path.abspath(out_dir)))
            convert(checkpoint_path, tmp, "torch_dist", iteration=iteration)
            src = paths.get_checkpoint_name(tmp, iteration, return_base_dir=True)
        _export(args, src, checkpoint_path, out_dir, vocab_size, family, max_shard_bytes, load_tensors_metadata)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _source_dirs(checkpoint_path, args):
    """Where the imported model's hf_config.json and tokenizer may be: this checkpoint, or the one it was
    trained from (--load / --pretrained-checkpoint of its run)."""
    dirs = [checkpoint_path, getattr(args, "load", None), getattr(args, "pretrained_checkpoint", None),
            getattr(args, "tokenizer_model", None)]
    return [d for d in dirs if d and os.path.isdir(d)]


def _export(args, src, checkpoint_path, out_dir, vocab_size, family, max_shard_bytes, load_tensors_metadata):
    dirs = _source_dirs(checkpoint_path, args)
    base_paths = [os.path.join(d, HF_CONFIG_NAME) for d in dirs if os.path.isfile(os.path.join(d, HF_CONFIG_NAME))]
    base = read_config_file(base_paths[0]) if base_paths else {}
    if family is not None:
        fam = FAMILIES[family]
    elif base:
        fam = family_for_config(base)
    else:
        fam = _infer_family(args)
    vocab = int(vocab_size or getattr(args, "vocab_size", None) or args.padded_vocab_size)
    meta = load_tensors_metadata(src)
    embedding = next(k for k in meta if k.endswith("embedding.word_embeddings.weight"))
    dtype = meta[embedding].dtype
    cfg = fam.args_to_config(args, vocab)
    cfg = dict(base, **cfg) if base else cfg
    if not cfg.get("rope_scaling"):
        cfg.pop("rope_scaling", None)
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).replace("torch.", "")
    flags = fam.config_to_flags(cfg)
    if any(k.endswith("experts.weight1") for k in meta):  # trained with --moe-grouped-gemm
        flags.append(("--moe-grouped-gemm", None))
    shapes = shapes_from_flags(flags, vocab, meta[embedding].global_shape[0])
    writer = ShardedSafetensorsWriter(out_dir, max_shard_bytes)
    for name, tensor in ours_to_hf(fam, cfg, shapes, lambda names: read_global(src, names, meta)):
        writer.add(name, tensor)
    for name, tensor in (fam.extra_hf_tensors(cfg) if fam.extra_hf_tensors else {}).items():
        writer.add(name, tensor.to(dtype))
    writer.close()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for d in dirs:
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(d, name)) and not os.path.exists(os.path.join(out_dir, name)):
                shutil.copy2(os.path.join(d, name), os.path.join(out_dir, name))


def read_config_file(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
