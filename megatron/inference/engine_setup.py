"""Shared start-up of the generation tools: flags, process groups, model + checkpoint, engine.

The tools serve a GPT checkpoint (pretrain_gpt.py's model) or a vision-language one (pretrain_vlm.py's
LLaVA, whose saved flags include the vision ones): ``checkpoint_is_vlm`` tells which.
"""
import sys

import torch

from megatron.core import parallel_state
from megatron.core.inference import InferenceEngine
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.utils import unwrap_model
from megatron.training.arguments import parse_args
from megatron.training.arguments.inference_args import add_text_generate_args
from megatron.training.arguments.vision_args import add_vlm_args
from megatron.training.checkpointing import load_checkpoint
from megatron.training.checkpointing.args import has_checkpoint, read_checkpoint_args
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.initialize import initialize_megatron
from megatron.training.model_setup import get_model
from megatron.training.utils import print_rank_0


def add_generation_args(parser):
    """The generation tools' flags and pretrain_vlm.py's (a vision-language checkpoint's architecture)."""
    return add_vlm_args(add_text_generate_args(parser))


def checkpoint_is_vlm(args) -> bool:
    """True when --load holds a checkpoint saved with pretrain_vlm.py's flags (a LLaVA model)."""
    if not args.load or not has_checkpoint(args.load):
        return False
    saved, _ = read_checkpoint_args(args.load)
    return hasattr(saved, "vision_model_type")


# Megatron's --cuda-graph-scope values: the training step's layer parts, and its spelling of inference graphs.
CUDA_GRAPH_SCOPES = ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba",
                     "full_iteration_inference")


def resolve_decode_graph_flags(args) -> None:
    """Megatron's CUDA-graph flags as its inference scripts pass them (``--cuda-graph-impl local``, the older
    ``--enable-cuda-graph``, ``--cuda-graph-scope full_iteration_inference``, ``--cuda-graph-modules``) ask the
    inference engine for CUDA graphs. Here the engine captures the whole decode step (every layer and the
    sampling) on CUDA, so any of them turns that graph on: a per-layer scope names parts of what the step's
    graph already holds. They are then cleared, so the training step's checks
    (``fast_path.validate_cuda_graph_args``, which builds only the training step's graph) do not refuse them.
    ``--inference-cuda-graph-scope none`` beside them is a contradiction, refused."""
    scope = list(args.cuda_graph_scope or []) + list(getattr(args, "cuda_graph_modules", None) or [])
    unknown = [s for s in scope if s not in CUDA_GRAPH_SCOPES]
    if unknown:
        sys.exit(f"error: --cuda-graph-scope / --cuda-graph-modules {' '.join(unknown)}: not a scope; Megatron's are "
                 f"{', '.join(CUDA_GRAPH_SCOPES)}")
    asked = (args.cuda_graph_impl != "none" or args.enable_cuda_graph or args.external_cuda_graph or scope)
    if not asked:
        return
    if args.inference_cuda_graph_scope == "none":
        named = "--enable-cuda-graph" if args.enable_cuda_graph else "--external-cuda-graph" \
            if args.external_cuda_graph else f"--cuda-graph-impl {args.cuda_graph_impl}" \
            if args.cuda_graph_impl != "none" else f"--cuda-graph-scope {' '.join(scope)}"
        sys.exit(f"error: {named} asks for decode CUDA graphs and --inference-cuda-graph-scope none for none; "
                 "drop one of them")
    args.inference_cuda_graph_scope = args.inference_cuda_graph_scope or "block"
    args.cuda_graph_impl, args.cuda_graph_scope, args.cuda_graph_modules = "none", None, []
    args.enable_cuda_graph = args.external_cuda_graph = False


def initialize_generation(extra_args_provider=add_generation_args):
    """initialize_megatron for inference: no training run, data or optimizer state needed."""
    args = parse_args(extra_args_provider)
    resolve_decode_graph_flags(args)
    args.skip_train = True
    has_data = args.mock_data or args.data_path or args.data_args_path or args.train_data_path \
        or args.valid_data_path or args.test_data_path or args.per_split_data_args_path
    if not has_data:
        args.mock_data = True  # no data is read; this only satisfies the training-data check
    if args.load is not None:
        args.exit_on_missing_checkpoint = True
    initialize_megatron(parsed_args=args, args_defaults={"micro_batch_size": 1, "no_load_rng": True,
                                                         "no_load_optim": True})
    args = get_args()
    # Generation feeds one token per step: activations cannot be split along the sequence.
    args.sequence_parallel = False
    return args


def build_engine(args, model_provider) -> InferenceEngine:
    """Model from ``model_provider`` (+ --load), wrapped in an engine sized by the inference flags."""
    if args.virtual_pipeline_model_parallel_size is not None:
        sys.exit("error: text generation does not support virtual pipeline stages; drop "
                 "--num-layers-per-virtual-pipeline-stage")
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        sys.exit("error: --pipeline-model-parallel-size > 1: text generation runs on PP=1 (use TP, and load the "
                 "checkpoint at PP=1: torch_dist checkpoints reshard on load)")
    # --torch-compile compiles the engine's whole decode step (below), not each layer as in training.
    compile_decode, args.torch_compile = args.torch_compile, False
    model = get_model(model_provider, wrap_with_ddp=False)
    if args.load is not None:
        load_checkpoint(model, None, None, strict=True)
    else:
        print_rank_0("WARNING: no --load: generating from randomly initialized weights")
    tokenizer = get_tokenizer()
    max_len = args.inference_max_seq_length
    if args.position_embedding_type == "learned_absolute":
        max_len = min(max_len, args.max_position_embeddings)  # no position table beyond this
    graphs = None if args.inference_cuda_graph_scope is None else args.inference_cuda_graph_scope != "none"
    slots = args.inference_max_requests
    if args.inference_dynamic_batching_buffer_size_gb is not None:
        try:
            slots = kv_cache_slots(model[0], args.inference_dynamic_batching_buffer_size_gb, max_len,
                                   args.inference_dynamic_batching_max_requests)
        except ValueError as e:
            sys.exit(f"error: {e}")
    try:
        engine = _engine(args, model, tokenizer, slots, max_len, graphs, compile_decode)
    except NotImplementedError as e:  # a model the chosen engine options cannot serve: one line
        sys.exit(f"error: {e}")
    if engine.device.type == "cuda" and engine.dtype == torch.float32:
        print_rank_0("WARNING: generating in fp32 on the GPU; pass --bf16 (half the bytes read per token)")
    print_rank_0(f"> generation engine: {slots} slots x {max_len} tokens, "
                 f"{engine.dtype}, CUDA graphs {'on' if engine.graphs is not None else 'off'}")
    return engine


def _engine(args, model, tokenizer, slots: int, max_len: int, graphs, compile_decode: bool) -> InferenceEngine:
    return InferenceEngine(model[0], max_batch_size=slots, max_sequence_length=max_len,
                           vocab_size=tokenizer.vocab_size, termination_id=_eod(tokenizer),
                           detokenize=tokenizer.detokenize, use_cuda_graphs=graphs, compile_decode=compile_decode,
                           log_step_interval=args.inference_logging_step_interval,
                           num_batch_graphs=args.inference_dynamic_batching_num_cuda_graphs,
                           chunked_prefill=args.enable_chunked_prefill,
                           graph_sizing=args.inference_dynamic_batching_cuda_graph_sizing_distribution,
                           prefix_caching=args.inference_dynamic_batching_enable_prefix_caching,
                           prefix_block_size=args.inference_dynamic_batching_block_size,
                           prefix_eviction_policy=args.inference_dynamic_batching_prefix_caching_eviction_policy,
                           **({} if args.inference_dynamic_batching_max_tokens is None else
                              {"max_prefill_tokens": args.inference_dynamic_batching_max_tokens}))


def kv_cache_slots(model, buffer_gb: float, max_len: int, max_requests=None) -> int:
    """--inference-dynamic-batching-buffer-size-gb: the KV-cache slots of ``max_len`` tokens that fit in that many
    GiB on this rank (each attention layer keeps a key and a value of its local query groups per token), at most
    ``max_requests`` (--inference-dynamic-batching-max-requests). Megatron's dynamic engine pages its buffer and
    admits requests while it holds their actual tokens; the engine here reserves each slot's whole length, so the
    same buffer holds fewer requests."""
    flag = f"--inference-dynamic-batching-buffer-size-gb {buffer_gb:g}"
    inner = unwrap_model(model)
    language = getattr(inner, "language_model", inner)  # a vision-language model caches its text decoder only
    if getattr(inner.config, "multi_latent_attention", False) or isinstance(language, HybridModel):
        raise ValueError(f"{flag} sizes the KV cache of standard attention layers; for this model (latent "
                         "attention or recurrent layers) pass --inference-max-requests")
    item = next(model.parameters()).element_size()
    attention = [m for m in language.decoder.modules() if hasattr(m, "ng") and hasattr(m, "hn")
                 and hasattr(m, "linear_qkv")]
    per_token = sum(2 * m.ng * m.hn * item for m in attention)
    if not per_token:
        raise ValueError(f"{flag}: the model has no attention layer to size a KV cache for")
    slots = int(buffer_gb * 2 ** 30 // (per_token * max_len))
    if slots < 1:
        raise ValueError(f"{flag} holds no request of {max_len} tokens (one needs {per_token * max_len / 2 ** 30:.3g} "
                         "GiB): raise it or lower --inference-max-seq-length")
    return min(slots, max_requests) if max_requests else slots


def _eod(tokenizer):
    try:
        return tokenizer.eod
    except (AttributeError, NotImplementedError, ValueError):
        return None
