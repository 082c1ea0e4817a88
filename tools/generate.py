"""One-shot generation from a checkpoint: print each prompt's continuation.

    python tools/generate.py --load CKPT --use-checkpoint-args --tokenizer-type GPT2BPETokenizer \
        --vocab-file data/vocab.json --merge-file data/merges.txt --prompt "Once upon a time" \
        --num-tokens-to-generate 32 [--temperature 0.8 --top_k 40 --seed 1234]

Greedy by default (--top_k 1); the sampling seed is --seed. Runs under torchrun for TP > 1.
A vision-language checkpoint (pretrain_vlm.py's) takes images: --image FILE (repeatable), one per
<image> tag of the prompts, in order; a single prompt without tags gets its images first:

    python tools/generate.py --load VLM_CKPT --use-checkpoint-args --prompt "<image> Describe it." \
        --image cat.png --num-tokens-to-generate 32
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import torch  # noqa: E402

from megatron.core.inference import SamplingParams  # noqa: E402
from megatron.inference.endpoints import tokenize  # noqa: E402
from megatron.inference.engine_setup import build_engine, checkpoint_is_vlm, initialize_generation  # noqa: E402
from megatron.inference.images import ImageConfig, assign_images, image_tiles, tokenize_with_images  # noqa: E402
from megatron.training.global_vars import get_tokenizer  # noqa: E402
from pretrain_gpt import model_provider as gpt_model_provider  # noqa: E402
from pretrain_hybrid import model_provider as hybrid_model_provider  # noqa: E402
from pretrain_vlm import model_provider as vlm_model_provider  # noqa: E402


def prompts_with_images(args, prompts, tokenizer):
    """Token lists of ``prompts`` and each one's images (tiles, tiles per image) for a vision-language model."""
    config = ImageConfig.from_args(args)
    try:
        images = [image_tiles(path, config, f"--image {path}") for path in args.image or []]
        prompts, per_prompt = assign_images(prompts, images)
    except ValueError as e:
        sys.exit(f"error: {e}")
    ids = [tokenize_with_images(tokenizer, p, config.image_token_index, add_bos=not p) for p in prompts]
    return prompts, ids, [None if im is None else im.tiles for im in per_prompt], \
        [None if im is None else im.num_image_tiles for im in per_prompt]


def main():
    args = initialize_generation()
    prompts = (args.prompts or []) + (args.prompt or [])
    if not prompts:
        sys.exit("error: pass --prompt TEXT (repeatable) or --prompts TEXT [TEXT ...]")
    vlm = checkpoint_is_vlm(args)
    if args.image and not vlm:
        sys.exit("error: --image needs a vision-language checkpoint (saved by pretrain_vlm.py) under --load")
    tokenizer = get_tokenizer()
    images = tiles = None
    if vlm:  # read the images before building the model: a bad file fails at once
        prompts, ids, images, tiles = prompts_with_images(args, prompts, tokenizer)
    else:
        ids = [tokenize(tokenizer, p, add_bos=not p) for p in prompts]
    # --use-checkpoint-args sets the vision flags / --is-hybrid-model (and the layer pattern) from the checkpoint
    provider = vlm_model_provider if vlm else hybrid_model_provider if args.is_hybrid_model else gpt_model_provider
    engine = build_engine(args, provider)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            num_tokens_to_generate=args.num_tokens_to_generate,
                            return_log_probs=args.return_log_probs, random_seed=args.seed)
    try:
        reqs = engine.generate(ids, params, images, tiles)
    except ValueError as e:
        sys.exit(f"error: {e} (see --inference-max-seq-length, --num-tokens-to-generate)")
    if torch.distributed.get_rank() != 0:
        return
    for prompt, req in zip(prompts, reqs):
        print(f"\n=== prompt: {prompt!r}\n{prompt}{req.generated_text}", flush=True)
        line = f"--- {len(req.generated_tokens)} tokens ({req.finish_reason})"
        if args.return_log_probs and req.generated_log_probs:
            line += f", mean log-prob {sum(req.generated_log_probs) / len(req.generated_log_probs):.3f}"
        print(f"{line}, ids {req.generated_tokens}", flush=True)


if __name__ == "__main__":
    main()
