"""Convert a GPT checkpoint between formats and parallel layouts, or from / to Hugging Face, offline on CPU.

Our checkpoints, torch <-> torch_dist and any TP/PP layout:
    python tools/checkpoint/convert.py --load-dir A --save-dir B --target-format torch|torch_dist \\
        [--target-tensor-parallel-size T] [--target-pipeline-parallel-size P] [--iteration N]
Megatron-LM's own torch_dist layout (stacked layers; model weights, which Megatron-LM --load reads; a training run
saves its whole state so with --ckpt-save-megatron-layout):
    python tools/checkpoint/convert.py --loader core --saver megatron --load-dir A --save-dir B \
        [--target-tensor-parallel-size T] [--target-pipeline-parallel-size P]
Hugging Face in and out (Megatron's spelling; loaders llama_mistral and mixtral_hf are aliases of hf):
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver core --load-dir HF_DIR \\
        --save-dir OUT --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    python tools/checkpoint/convert.py --model-type GPT --loader core --saver hf --load-dir CKPT --save-dir HF_DIR
MoE (Mixtral, Qwen3-MoE, DeepSeek-V3) imports also take --target-expert-parallel-size E and --moe-grouped-gemm.

Layout conversions spawn one gloo process per target model-parallel rank (see
megatron/training/checkpointing/convert.py); optimizer and RNG state are not converted, so a run
loading the result starts with a fresh optimizer. Hugging Face conversions stream tensor by tensor
(megatron/training/checkpointing/hf.py).
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron.training.checkpointing.convert import convert  # noqa: E402

HF_LOADERS = ("hf", "llama_mistral", "mixtral_hf")
CORE = ("core", "mcore", "megatron")


def _hf(opts):
    from megatron.training.checkpointing.hf import USER_ERRORS, export_hf_checkpoint, import_hf_checkpoint
    if opts.model_type != "GPT":
        raise SystemExit(f"error: --model-type {opts.model_type}: Hugging Face conversion handles GPT models only")
    if opts.checkpoint_type == "meta":
        raise SystemExit("error: --checkpoint-type meta (consolidated.*.pth) is not supported; convert the "
                         "Hugging Face release (config.json + safetensors) with --checkpoint-type hf")
    if not ((opts.loader in HF_LOADERS and opts.saver in CORE) or (opts.loader in CORE and opts.saver == "hf")):
        raise SystemExit(f"error: --loader {opts.loader} --saver {opts.saver} is not a supported pair; use "
                         f"--loader hf --saver core (import) or --loader core --saver hf (export)")
    if opts.saver == "hf" and (opts.target_expert_parallel_size not in (None, 1) or opts.moe_grouped_gemm):
        raise SystemExit("error: --target-expert-parallel-size / --moe-grouped-gemm apply to imports (--saver core); "
                         "export reads any layout")
    try:
        if opts.saver in CORE:
            import_hf_checkpoint(opts.load_dir, opts.save_dir, tp=opts.target_tensor_parallel_size or 1,
                                 pp=opts.target_pipeline_parallel_size or 1, fmt=opts.target_format or "torch_dist",
                                 make_vocab_size_divisible_by=opts.make_vocab_size_divisible_by,
                                 ep=opts.target_expert_parallel_size or 1, moe_grouped_gemm=opts.moe_grouped_gemm)
        else:
            export_hf_checkpoint(opts.load_dir, opts.save_dir, iteration=opts.iteration,
                                 vocab_size=opts.true_vocab_size)
    except USER_ERRORS as e:
        raise SystemExit(f"error: {e.args[0] if e.args else e}")
    print(f"converted {opts.load_dir} ({opts.loader}) to {opts.save_dir} ({opts.saver})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load-dir", required=True, help="Source: our --save directory, or a HF model directory.")
    parser.add_argument("--save-dir", required=True, help="Where to write the converted checkpoint.")
    parser.add_argument("--target-format", choices=["torch", "torch_dist"], default=None,
                        help="Our checkpoint format to write (default torch_dist with --saver core).")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=None, help="Default: the source's.")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=None, help="Default: the source's.")
    parser.add_argument("--target-expert-parallel-size", type=int, default=None,
                        help="MoE import: expert-parallel size recorded in the args (torch_dist loads under any).")
    parser.add_argument("--moe-grouped-gemm", action="store_true",
                        help="MoE import: write GroupedMLP's stacked expert tensors (train with --moe-grouped-gemm).")
    parser.add_argument("--iteration", type=int, default=None, help="Source iteration (default: latest).")
    parser.add_argument("--model-type", default="GPT", choices=["GPT", "BERT"], help="Only GPT for --loader/--saver.")
    parser.add_argument("--loader", default=None, choices=HF_LOADERS + CORE,
                        help="hf (aliases llama_mistral, mixtral_hf) or core; omit for a layout/format conversion.")
    parser.add_argument("--saver", default=None, choices=CORE + ("hf",),
                        help="core, hf, or megatron (with --loader core: model weights in Megatron-LM's torch_dist "
                             "layout, which Megatron-LM loads; for the whole training state save with "
                             "--ckpt-save-megatron-layout instead).")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="Import pads the vocab to a multiple of this x target TP.")
    parser.add_argument("--true-vocab-size", type=int, default=None,
                        help="Export: rows of the vocab to keep (default: the imported model's, else the padded size).")
    parser.add_argument("--checkpoint-type", default="hf", choices=["hf", "meta"],
                        help="Loader input kind; only hf (config.json + safetensors) is read.")
    for flag in ("--model-size", "--tokenizer-model", "--loader-transformer-impl", "--saver-transformer-impl"):
        parser.add_argument(flag, default=None, help="Accepted for Megatron compatibility; no effect here "
                            "(the architecture comes from config.json, tokenizer files are copied).")
    for flag in ("--bf16", "--fp16"):
        parser.add_argument(flag, action="store_true", help="Accepted for Megatron compatibility; no effect "
                            "(tensors keep their stored dtype; choose the training precision when training).")
    parser.add_argument("--megatron-path", default=None, help="Accepted for Megatron compatibility; no effect here.")
    parser.add_argument("--max-queue-size", type=int, default=None,
                        help="Accepted for Megatron compatibility; no effect (tensors stream without a queue).")
    opts = parser.parse_args(argv)
    if opts.loader or opts.saver:
        if not (opts.loader and opts.saver):
            parser.error("--loader and --saver go together")
        if opts.loader in CORE and opts.saver in CORE:
            megatron_layout = opts.saver == "megatron"
            opts.loader = opts.saver = None  # our format to our format: a layout conversion
            if megatron_layout:
                if opts.target_format not in (None, "torch_dist"):
                    parser.error("--saver megatron writes Megatron-LM's torch_dist layout; drop --target-format")
                opts.target_format = "torch_dist"
        else:
            return _hf(opts)
    else:
        megatron_layout = False
    if opts.target_format is None:
        parser.error("--target-format is required for a layout/format conversion")
    if opts.target_expert_parallel_size not in (None, 1) or opts.moe_grouped_gemm:
        parser.error("--target-expert-parallel-size / --moe-grouped-gemm apply to Hugging Face imports only "
                     "(a torch_dist checkpoint loads under any --expert-model-parallel-size)")
    convert(opts.load_dir, opts.save_dir, opts.target_format, opts.target_tensor_parallel_size,
            opts.target_pipeline_parallel_size, opts.iteration, megatron_layout=megatron_layout)


if __name__ == "__main__":
    main()
