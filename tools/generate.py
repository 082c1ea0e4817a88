"""One-shot generation from a checkpoint: print each prompt's continuation.

    python tools/generate.py --load CKPT --use-checkpoint-args --tokenizer-type GPT2BPETokenizer \
        --vocab-file data/vocab.json --merge-file data/merges.txt --prompt "Once upon a time" \
        --num-tokens-to-generate 32 [--temperature 0.8 --top_k 40 --seed 1234]

Greedy by default (--top_k 1); the sampling seed is --seed. Runs under torchrun for TP > 1.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import torch  # noqa: E402

import pretrain_gpt  # noqa: E402
import pretrain_hybrid  # noqa: E402
from megatron.core.inference import SamplingParams  # noqa: E402
from megatron.inference.endpoints import tokenize  # noqa: E402
from megatron.inference.engine_setup import build_engine, initialize_generation  # noqa: E402
from megatron.training.global_vars import get_tokenizer  # noqa: E402


def main():
    args = initialize_generation()
    prompts = (args.prompts or []) + (args.prompt or [])
    if not prompts:
        sys.exit("error: pass --prompt TEXT (repeatable) or --prompts TEXT [TEXT ...]")
    # --use-checkpoint-args sets --is-hybrid-model (and the layer pattern) from a hybrid checkpoint
    provider = pretrain_hybrid if args.is_hybrid_model else pretrain_gpt
    engine = build_engine(args, provider.model_provider)
    tokenizer = get_tokenizer()
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            num_tokens_to_generate=args.num_tokens_to_generate,
                            return_log_probs=args.return_log_probs, random_seed=args.seed)
    ids = [tokenize(tokenizer, p, add_bos=not p) for p in prompts]
    try:
        reqs = engine.generate(ids, params)
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
