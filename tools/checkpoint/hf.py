"""Hugging Face <-> Megatron checkpoints (Megatron Bridge's spelling), offline on CPU.

    python tools/checkpoint/hf.py import --hf-model-path HF_DIR --output-path OUT [--tp 2 --pp 2] [--format torch]
        [--ep 2] [--moe-grouped-gemm]
    python tools/checkpoint/hf.py export --checkpoint-path OUT --output-path HF_DIR

Import writes OUT/iter_0000000 (+ tracker), the args for --use-checkpoint-args, OUT/model_args.sh with
the equivalent flags, and the tokenizer files (--tokenizer-type HuggingFaceTokenizer --tokenizer-model OUT).
Supported: GPT-2, Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3, and the hybrid
models Mamba2, Nemotron-H and Qwen3-Next (pretrain_hybrid.py checkpoints).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF model directory -> our checkpoint")
    imp.add_argument("--hf-model-path", required=True, help="Local HF directory (config.json + *.safetensors).")
    imp.add_argument("--output-path", required=True, help="Our checkpoint directory to create (use as --load).")
    imp.add_argument("--tp", type=int, default=1, help="Tensor-parallel size the checkpoint is padded/recorded for.")
    imp.add_argument("--pp", type=int, default=1, help="Pipeline-parallel size recorded in the args.")
    imp.add_argument("--format", default="torch_dist", choices=["torch_dist", "torch"], help="Checkpoint format.")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    imp.add_argument("--ep", type=int, default=1, help="MoE: expert-parallel size recorded in the args.")
    imp.add_argument("--moe-grouped-gemm", action="store_true",
                     help="MoE: write GroupedMLP's stacked expert tensors (train with --moe-grouped-gemm).")
    exp = sub.add_parser("export", help="our checkpoint -> HF model directory")
    exp.add_argument("--checkpoint-path", required=True, help="Our --save directory (any format and layout).")
    exp.add_argument("--output-path", required=True, help="HF directory to write (config.json, safetensors).")
    exp.add_argument("--iteration", type=int, default=None, help="Default: the latest.")
    exp.add_argument("--vocab-size", type=int, default=None, help="Vocab rows to keep (default: the true vocab).")
    exp.add_argument("--max-shard-size-gb", type=float, default=5.0, help="Size of each safetensors shard.")
    opts = parser.parse_args(argv)
    from megatron.training.checkpointing.hf import USER_ERRORS, export_hf_checkpoint, import_hf_checkpoint
    try:
        if opts.command == "import":
            out = import_hf_checkpoint(opts.hf_model_path, opts.output_path, tp=opts.tp, pp=opts.pp, fmt=opts.format,
                                       make_vocab_size_divisible_by=opts.make_vocab_size_divisible_by, ep=opts.ep,
                                       moe_grouped_gemm=opts.moe_grouped_gemm)
            print(f"imported {opts.hf_model_path} -> {out}; flags in {os.path.join(opts.output_path, 'model_args.sh')}")
        else:
            out = export_hf_checkpoint(opts.checkpoint_path, opts.output_path, iteration=opts.iteration,
                                       vocab_size=opts.vocab_size,
                                       max_shard_bytes=int(opts.max_shard_size_gb * 2 ** 30))
            print(f"exported {opts.checkpoint_path} -> {out}")
    except USER_ERRORS as e:
        raise SystemExit(f"error: {e.args[0] if e.args else e}")


if __name__ == "__main__":
    main()
