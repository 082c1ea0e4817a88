"""REST server for text generation (Megatron's tools/run_text_generation_server.py).

    python tools/run_text_generation_server.py --load CKPT --use-checkpoint-args \
        --tokenizer-type GPT2BPETokenizer --vocab-file data/vocab.json --merge-file data/merges.txt --port 5000
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \
        -d '{"prompts": ["Hello"], "tokens_to_generate": 32}'

Under torchrun with TP > 1, rank 0 serves HTTP and broadcasts each step's new prompts to the others.
A vision-language checkpoint (pretrain_vlm.py's) takes images with the prompts, base64 in the request:
    -d '{"prompts": ["<image> Describe it."], "tokens_to_generate": 32, "multi_modal_data": {"image": ["iVBOR..."]}}'
"""
import os
import signal
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import torch  # noqa: E402

from megatron.inference.engine_setup import build_engine, checkpoint_is_vlm, initialize_generation  # noqa: E402
from megatron.inference.images import ImageConfig  # noqa: E402
from megatron.inference.scheduler import GenerationScheduler, follow  # noqa: E402
from megatron.inference.text_generation_server import MegatronServer  # noqa: E402
from megatron.training.global_vars import get_tokenizer  # noqa: E402
from pretrain_gpt import model_provider as gpt_model_provider  # noqa: E402
from pretrain_hybrid import model_provider as hybrid_model_provider  # noqa: E402
from pretrain_vlm import model_provider as vlm_model_provider  # noqa: E402


def main():
    args = initialize_generation()
    vlm = checkpoint_is_vlm(args)
    # --use-checkpoint-args sets the vision flags / --is-hybrid-model (and the layer pattern) from the checkpoint
    provider = vlm_model_provider if vlm else hybrid_model_provider if args.is_hybrid_model else gpt_model_provider
    engine = build_engine(args, provider)
    if torch.distributed.get_rank() != 0:
        follow(engine)
        return
    scheduler = GenerationScheduler(engine)
    defaults = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    name = os.path.basename(os.path.normpath(args.load)) if args.load else "megatron"
    server = MegatronServer(scheduler, get_tokenizer(), defaults, model_name=name,
                            image_config=ImageConfig.from_args(args) if vlm else None)
    server.start("0.0.0.0", args.port)
    print(f"> serving on port {args.port}: PUT /api, POST /completions", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    try:
        scheduler.run()
    except KeyboardInterrupt:
        server.shutdown()
        scheduler.run()  # tells the other ranks to stop


if __name__ == "__main__":
    main()
