"""Checks of the GPU fast-path flags: --transformer-impl, --attention-backend, --use-flash-attn, --fp8-*,
--cuda-graph-*.

--transformer-impl transformer_engine (Megatron's default) builds this project's fused torch layers: the
same functions as Transformer Engine's, other kernels; the model's state dict keeps Megatron's TE-spec key
names (megatron/core/transformer/te_key_map.py). Each mapping is listed once in the start-up log.
--use-flash-attn selects torch SDPA's flash kernel.
"""

TE_MAPPED = ("--transformer-impl transformer_engine runs this project's fused torch layers: same functions, "
             "different kernels (checkpoints keep Megatron's TE-spec key names)")
# Transformer Engine's attention backends -> the torch SDPA kernels that dot_product_attention.py asks for.
ATTENTION_BACKENDS = {
    "flash": "torch SDPA's flash kernel", "fused": "torch SDPA's cuDNN / memory-efficient kernels",
    "unfused": "torch SDPA's math kernel (unfused softmax(QK^T)V)",
    "local": "torch SDPA, which picks its kernel (as auto)",
}


def validate_fast_path_args(args, require, say=print):
    """``require(cond, message)`` raises the argument error of validate_args; ``say`` logs a start-up line."""
    if args.transformer_impl == "transformer_engine" and args.rank == 0:
        say(TE_MAPPED)
    if args.use_flash_attn:
        require(args.attention_backend in ("auto", "flash"),
                f"--use-flash-attn conflicts with --attention-backend {args.attention_backend}; pass one of them")
        args.attention_backend = "flash"
    elif args.attention_backend != "auto" and args.rank == 0:
        say(f"--attention-backend {args.attention_backend} runs {ATTENTION_BACKENDS[args.attention_backend]}")
    if args.fp8 is not None:
        from megatron.core.fp8 import FP8_RECIPES  # lazy: loads fp8_linear and torch._dynamo (~0.5 s); --fp8 only
        require(args.fp8_recipe in FP8_RECIPES,
                f"--fp8-recipe {args.fp8_recipe} is not supported without Transformer Engine; use "
                "--fp8-recipe tensorwise")
        require(args.fp8_amax_history_len == 1 and args.fp8_amax_compute_algo == "most_recent",
                "--fp8-amax-history-len / --fp8-amax-compute-algo belong to the delayed FP8 recipe, which is "
                "not supported; drop them")
        require(args.fp8_margin >= 0, f"--fp8-margin ({args.fp8_margin}) must be >= 0")
    validate_cuda_graph_args(args, require)


def validate_cuda_graph_args(args, require):
    """Resolve the CUDA-graph spellings to ``args.cuda_graph_impl`` and refuse what cannot be captured."""
    if args.enable_cuda_graph:
        require(args.cuda_graph_impl in ("none", "local"),
                f"--enable-cuda-graph conflicts with --cuda-graph-impl {args.cuda_graph_impl}")
        args.cuda_graph_impl = "local"
    if args.external_cuda_graph:
        require(args.cuda_graph_impl in ("none", "transformer_engine"),
                f"--external-cuda-graph conflicts with --cuda-graph-impl {args.cuda_graph_impl}")
        args.cuda_graph_impl = "transformer_engine"
    scope = args.cuda_graph_scope or []
    if args.cuda_graph_impl == "local" and scope == ["full_iteration"]:
        args.cuda_graph_impl = "full_iteration"
    require(args.cuda_graph_impl != "transformer_engine",
            "--cuda-graph-impl transformer_engine (--external-cuda-graph) needs Transformer Engine layers, "
            "which are not integrated; use --cuda-graph-impl full_iteration")
    require(args.cuda_graph_impl != "local",
            "--cuda-graph-impl local (--enable-cuda-graph): per-layer CUDA graphs are not built; use "
            "--cuda-graph-impl full_iteration (one graph for the forward and backward of the whole step)")
    if args.cuda_graph_impl == "none":
        require(not scope, "--cuda-graph-scope needs --cuda-graph-impl full_iteration")
        return
    require(not scope or scope == ["full_iteration"],
            f"--cuda-graph-scope {' '.join(scope)}: only full_iteration is built")
    require(args.cuda_graph_warmup_steps >= 1,
            f"--cuda-graph-warmup-steps must be >= 1 (got {args.cuda_graph_warmup_steps})")
    flag = "--cuda-graph-impl full_iteration"
    # Each refusal names the blocker: a host sync, an exchange outside the graph, or RNG states saved
    # through the host inside the step.
    # PP is captured, interleaved too: the schedule's order and shapes are fixed and its sends and receives
    # are NCCL operations; the data iterators a step reads (first stage, last stage; the first or last model
    # chunk's) each refill their own batch buffers, learnt during the warm-up steps.
    if args.tensor_model_parallel_size > 1:
        # TP is captured: TP rank 0's batch broadcast has shapes every rank knows (no size exchange), and the
        # sequence-parallel all-gathers / reduce-scatters and the vocab-parallel loss are NCCL collectives.
        tp = f"{flag} with --tensor-model-parallel-size > 1"
        require(not args.tp_comm_overlap,
                f"{tp}: --tp-comm-overlap pipelines its transfers on a side stream with symmetric-memory "
                "barriers the graph does not capture; drop one of the two")
        require(not (args.reset_attention_mask or getattr(args, "sft", False)),
                f"{tp}: packed documents' offsets differ per sample, so their broadcast reads sizes on the "
                "host; drop --reset-attention-mask / --sft or the TP size")
    require(not getattr(args, "defer_embedding_wgrad_compute", False),
            f"{flag} with --defer-embedding-wgrad-compute: the parked output-layer GEMMs are paired with their "
            "gradients in Python lists the replayed graph does not run; drop one of the two")
    # CP is captured: each rank keeps its chunks by fixed index arithmetic, and the ring's sends and receives
    # (or the all-gather / all-to-all of the other --cp-comm-type values) have fixed shapes.
    require(args.context_parallel_size == 1 or not (args.reset_attention_mask or getattr(args, "sft", False)),
            f"{flag} with --context-parallel-size > 1: packed documents' boundaries differ per sample; drop "
            "--reset-attention-mask / --sft or the graph")
    # MoE: with every expert on every rank the layer reads nothing on the host. Spread over ranks (EP, expert-TP,
    # or TP's expert split), the all-to-all needs each step's split sizes on the host, unless every expert is
    # padded to its capacity, which fixes them (the tokens-per-expert tensor is then made once on the device).
    expert_ranks = max(args.expert_model_parallel_size, args.tensor_model_parallel_size,
                       getattr(args, "expert_tensor_parallel_size", None) or 1)
    if args.num_experts and expert_ranks > 1:
        require(args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is not None
                and args.moe_token_dispatcher_type == "alltoall",
                f"{flag} with experts over several ranks needs fixed all-to-all split sizes: pass "
                "--moe-token-dispatcher-type alltoall --moe-expert-capacity-factor F "
                "--moe-pad-expert-input-to-capacity (otherwise the token counts are read on the host each step)")
    if args.num_experts:
        # The local experts read nothing on the host only as one grouped GEMM over device offsets (bf16); the
        # per-expert loop splits its rows by counts read on the host, as does dropping without padding.
        require(args.moe_grouped_gemm and args.bf16,
                f"{flag} with --num-experts needs --moe-grouped-gemm and --bf16: the experts then run as one "
                "grouped GEMM over device offsets; the per-expert loop reads the token counts on the host")
        require(args.moe_expert_capacity_factor is None or args.moe_pad_expert_input_to_capacity,
                f"{flag} with --moe-expert-capacity-factor needs --moe-pad-expert-input-to-capacity: without it "
                "the number of kept tokens is counted on the host each step")
    # Data parallelism is captured with the graph: the DDP buckets' NCCL all-reduce / reduce-scatter
    # are recorded in it (NCCL >= 2.9.6). The distributed optimizer's overlapped param all-gather is not:
    # it is launched after the optimizer step, outside the graph, and waited on inside the forward.
    require(not args.overlap_param_gather,
            f"{flag}: --overlap-param-gather waits inside the captured forward on an all-gather launched "
            "outside the graph; drop it (the distributed optimizer then gathers params in its step)")
    require(not args.use_torch_fsdp2, f"{flag} does not support --use-torch-fsdp2")
    require(not args.cpu_offloading_num_layers,
            f"{flag}: --cpu-offloading-num-layers allocates host buffers for each step's activations, which a graph "
            "cannot capture; drop one")
    require(args.num_distributed_optimizer_instances == 1,
            f"{flag}: the gradient reduction over several distributed-optimizer instances runs on a side stream "
            "that is not captured yet; drop --num-distributed-optimizer-instances")
    require(args.rampup_batch_size is None and args.step_batch_size_schedule is None,
            f"{flag} needs a fixed number of micro-batches per step; drop --rampup-batch-size / "
            "--step-batch-size-schedule")
    require(not args.calculate_per_token_loss,
            f"{flag}: --calculate-per-token-loss reads the token count on the host inside the step")
    require(args.recompute_granularity is None,
            f"{flag}: activation recompute saves and restores RNG states inside the step, which a graph "
            "cannot capture; drop --recompute-granularity / --recompute-activations")
    require(not args.fp16 or args.loss_scale is not None,
            f"{flag} with --fp16 needs a constant --loss-scale (the dynamic scaler skips steps on the host); "
            "or use --bf16")
