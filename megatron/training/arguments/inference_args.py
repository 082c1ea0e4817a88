"""Text-generation flags: Megatron's inference group (every entry point) and the generation tools' own
flags (tools/run_text_generation_server.py, tools/generate.py), with Megatron 0.19.2's names."""


import argparse


def add_inference_args(parser):
    g = parser.add_argument_group(title="inference")
    g.add_argument("--inference-max-requests", type=int, default=8,
                   help="KV-cache slots: requests decoded together (continuous batching).")
    g.add_argument("--inference-max-seq-length", type=int, default=2560,
                   help="Longest prompt + generation per request (KV-cache length per slot).")
    g.add_argument("--inference-cuda-graph-scope", type=str, default=None, choices=["none", "layer", "block"],
                   help="none: decode eagerly. Otherwise (default) each decode step on CUDA replays one CUDA "
                        "graph of the whole model and the sampling (layer and block both select it).")
    g.add_argument("--inference-dynamic-batching-max-requests", type=int, default=None,
                   help="Megatron's dynamic engine's cap on requests decoded together: here the KV-cache slots "
                        "(--inference-max-requests), which it replaces when given.")
    g.add_argument("--inference-dynamic-batching-buffer-size-gb", type=float, default=None,
                   help="KV-cache memory per rank: the engine takes as many slots of --inference-max-seq-length "
                        "tokens as fit (at most --inference-dynamic-batching-max-requests) instead of "
                        "--inference-max-requests. Megatron's dynamic engine pages this buffer (default 40 there); "
                        "here each slot reserves its whole length.")
    g.add_argument("--inference-dynamic-batching-max-tokens", type=int, default=None,
                   help="Tokens one prefill step may hold (prompts batched together up to it; a longer prompt runs "
                        "alone). Default 16384.")
    g.add_argument("--inference-dynamic-batching-num-cuda-graphs", type=int, default=16,
                   help="With decode CUDA graphs: at most this many batch sizes, the slot count halved down to 1 "
                        "(a step of n requests runs the smallest size >= n); fewer graphs to capture and hold, more "
                        "padded rows per step.")
    g.add_argument("--inference-dynamic-batching-cuda-graph-sizing-distribution", type=str, default="exponential",
                   choices=["exponential", "linear"],
                   help="The decode graphs' batch sizes: the slot count halved down to 1 (exponential), or "
                        "--inference-dynamic-batching-num-cuda-graphs sizes evenly spaced up to it (linear).")
    g.add_argument("--enable-chunked-prefill", action="store_true",
                   help="Prefill a prompt longer than --inference-dynamic-batching-max-tokens in chunks of at most "
                        "that many tokens (each attending to the cached ones before it): one forward's activations "
                        "stay bounded. Not with Mamba-2 / Gated DeltaNet layers or images.")
    g.add_argument("--inference-dynamic-batching-prefix-caching", action=argparse.BooleanOptionalAction,
                   dest="inference_dynamic_batching_enable_prefix_caching", default=False,
                   help="Prefix caching: a prompt starting with whole blocks of tokens whose keys and values a "
                        "KV-cache slot holds copies them into its own slot and prefills only the rest (the last "
                        "prompt token is always recomputed). Not with Mamba-2 / Gated DeltaNet layers or images.")
    g.add_argument("--inference-dynamic-batching-prefix-caching-eviction-policy", type=str, default="ref_zero",
                   choices=["ref_zero", "lru"],
                   help="Which slots give their prefix: ref_zero, those of requests still running; lru, finished "
                        "requests' slots too (kept until reused; a new request takes the free slot holding its "
                        "prefix, else the least recently used one).")
    g.add_argument("--inference-dynamic-batching-block-size", type=int, default=256,
                   help="Tokens per KV-cache block: prefix caching matches prompts in whole blocks. Megatron's dynamic "
                        "engine also pages its KV cache in these blocks; each slot here holds its whole length.")
    g.add_argument("--inference-logging-step-interval", type=int, default=0,
                   help="Every N engine steps, one line: requests active and waiting, prompt and generated "
                        "tokens since the last line and the generation rate (0: off).")
    return parser


def add_text_generate_args(parser):
    """The generation tools' flags (Megatron's tools/run_text_generation_server.py)."""
    g = parser.add_argument_group(title="text generation")
    g.add_argument("--port", type=int, default=5000, help="Port for the text generation server.")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="Sampling temperature; the server's default for requests that do not set one.")
    g.add_argument("--top_k", type=int, default=1, help="Top-k sampling (1 = greedy); server default too.")
    g.add_argument("--top_p", type=float, default=0.0, help="Top-p sampling (0 = off); server default too.")
    g.add_argument("--return-log-probs", action="store_true", default=True,
                   help="tools/generate.py prints the log-probabilities of the generated tokens.")
    g.add_argument("--num-tokens-to-generate", type=int, default=30, help="Tokens to generate per prompt.")
    g.add_argument("--prompts", metavar="N", type=str, nargs="+", help="Prompts (tools/generate.py).")
    g.add_argument("--prompt", type=str, action="append", help="One prompt (tools/generate.py); repeatable.")
    g.add_argument("--image", type=str, action="append",
                   help="An image file for a vision-language checkpoint (tools/generate.py); repeatable: the "
                        "prompts' <image> tags take the images in order (a single prompt without tags gets "
                        "them first).")
    g.add_argument("--max-batch-size", type=int, default=None, help="Deprecated: --inference-max-requests.")
    return parser


def validate_inference_args(args, require):
    """``require(cond, message)`` raises the argument error of validate_args."""
    require(args.inference_max_requests >= 1,
            f"--inference-max-requests ({args.inference_max_requests}) must be >= 1")
    require(args.inference_max_seq_length >= 2,
            f"--inference-max-seq-length ({args.inference_max_seq_length}) must be >= 2")
    # --max-batch-size and --top_k exist only where add_text_generate_args added them (the generation tools).
    if getattr(args, "max_batch_size", None) is not None:
        require(args.max_batch_size >= 1, f"--max-batch-size ({args.max_batch_size}) must be >= 1")
        args.inference_max_requests = args.max_batch_size
    if args.inference_dynamic_batching_max_requests is not None:
        require(args.inference_dynamic_batching_max_requests >= 1,
                f"--inference-dynamic-batching-max-requests ({args.inference_dynamic_batching_max_requests}) "
                "must be >= 1")
        args.inference_max_requests = args.inference_dynamic_batching_max_requests
    buffer_gb = args.inference_dynamic_batching_buffer_size_gb
    require(buffer_gb is None or buffer_gb > 0,
            f"--inference-dynamic-batching-buffer-size-gb ({buffer_gb}) must be > 0")
    require(args.inference_dynamic_batching_num_cuda_graphs >= 1,
            f"--inference-dynamic-batching-num-cuda-graphs ({args.inference_dynamic_batching_num_cuda_graphs}) must be "
            ">= 1")
    require(args.inference_dynamic_batching_max_tokens is None or args.inference_dynamic_batching_max_tokens >= 1,
            f"--inference-dynamic-batching-max-tokens ({args.inference_dynamic_batching_max_tokens}) must be >= 1")
    require(args.inference_dynamic_batching_block_size >= 1,
            f"--inference-dynamic-batching-block-size ({args.inference_dynamic_batching_block_size}) must be >= 1")
    require(args.inference_logging_step_interval >= 0,
            f"--inference-logging-step-interval ({args.inference_logging_step_interval}) must be >= 0")
    if getattr(args, "top_k", None) is not None:
        require(args.top_k >= 0, f"--top_k ({args.top_k}) must be >= 0")
        require(0.0 <= args.top_p <= 1.0, f"--top_p ({args.top_p}) must be in [0, 1]")
        require(args.top_k <= 1 or args.top_p == 0.0, "--top_k > 1 and --top_p > 0 are exclusive; pass one")
        require(0.0 <= args.temperature <= 100.0, f"--temperature ({args.temperature}) must be in [0, 100]")
        require(args.num_tokens_to_generate >= 0,
                f"--num-tokens-to-generate ({args.num_tokens_to_generate}) must be >= 0")
        require(1 <= args.port <= 65535, f"--port ({args.port}) must be in 1..65535")
