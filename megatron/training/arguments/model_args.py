"""Flags that describe the network, its initialization and its numeric precision (Megatron names/defaults)."""
import argparse


class _PaddedVocabSize(argparse.Action):
    """Stores --padded-vocab-size and remembers that the user set it (``requested_padded_vocab_size``): the
    tokenizer then uses it instead of the size it computes (and recomputes on a TP change)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.requested_padded_vocab_size = values


def add_network_size_args(parser):
    g = parser.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP hidden size; default 4*hidden (SwiGLU: 8/3*hidden rounded down to a multiple of 64).")
    g.add_argument("--num-attention-heads", type=int, default=None, help="Number of attention heads.")
    g.add_argument("--kv-channels", type=int, default=None, help="Per-head dim; default hidden/heads.")
    g.add_argument("--group-query-attention", action="store_true", help="Use grouped-query attention.")
    g.add_argument("--num-query-groups", type=int, default=1, help="KV groups (with --group-query-attention).")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Maximum sequence length (size of the learned position table / RoPE range).")
    g.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                   choices=["learned_absolute", "rope", "yarn", "mrope", "none"],
                   help="Position embedding type (yarn: with --multi-latent-attention; mrope: multimodal RoPE "
                        "with --mrope-section).")
    g.add_argument("--mrope-section", nargs="+", type=int, default=None,
                   help="Multimodal RoPE: rotary frequency bands of the temporal, height and width position "
                        "ids (sum: rotary dim / 2), e.g. 16 24 24.")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Deprecated alias of --position-embedding-type rope.")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="Disable position embeddings (deprecated; use --position-embedding-type none).")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE theta.")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="Fraction of the head dim rotated.")
    g.add_argument("--rotary-interleaved", action="store_true", help="Rotate interleaved pairs, not halves.")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                   help="Linear RoPE sequence-length interpolation factor.")
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama-3.x RoPE frequency scaling.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="RoPE scaling factor.")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
                   help="Disable the fused RoPE kernel.")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
                   help="Normalization layer.")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the normalization layers.")
    g.add_argument("--apply-layernorm-1p", action="store_true", help="Zero-centred gamma: weight + 1.")
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                   help="Residual taken after the layernorm (original BERT order).")
    g.add_argument("--openai-gelu", action="store_true", help="Tanh-approximated GeLU.")
    g.add_argument("--squared-relu", action="store_true", help="Squared ReLU activation.")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU activation (gated SiLU).")
    g.add_argument("--quick-geglu", action="store_true",
                   help="Gated quick-GeLU activation, x * sigmoid(1.702 x) on the gate (gpt-oss).")
    g.add_argument("--glu-linear-offset", type=float, default=0.0,
                   help="GLU as activation(gate) * (up + offset) (gpt-oss: 1.0); needs --swiglu or --quick-geglu.")
    g.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="Clamp the GLU's gate to at most this and its up half to [-value, value] before the "
                        "activation (gpt-oss: 7.0); needs --swiglu or --quick-geglu.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Separate output layer weights instead of reusing the word embedding.")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="Remove biases from all linear layers.")
    g.add_argument("--add-qkv-bias", action="store_true", help="Bias on the QKV projection only.")
    g.add_argument("--qk-layernorm", action="store_true", help="Normalize queries and keys per head.")
    g.add_argument("--attention-output-gate", action="store_true",
                   help="Gate the self-attention output per channel by sigmoid of a projection of the input "
                        "(linear_qkv also computes the gate; Qwen3-Next).")
    g.add_argument("--qk-l2-norm", action="store_true",
                   help="L2-normalize queries and keys per head, without a learned scale (Llama 4).")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this times the TP size.")
    g.add_argument("--padded-vocab-size", type=int, default=None, action=_PaddedVocabSize,
                   help="The model's vocabulary size itself (>= the tokenizer's, divisible by the TP size), "
                        "instead of padding to --make-vocab-size-divisible-by x TP: e.g. a checkpoint's 128256.")
    g.add_argument("--transformer-impl", default="local", choices=["local", "transformer_engine"],
                   help="Layer implementation. Default local (our torch layers; Megatron's default is "
                        "transformer_engine). transformer_engine runs the same fused torch layers (same "
                        "functions, different kernels) and keeps Megatron's TE-spec checkpoint key names.")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "flash", "fused", "unfused", "local"],
                   help="Core attention backend; all run through torch SDPA, which picks its kernel.")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="Flash attention: the same as --attention-backend flash (torch SDPA's flash kernel; "
                        "the flash_attn package is not used).")
    g.add_argument("--attention-softmax-in-fp32", action="store_true", help="Run the softmax in fp32.")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true",
                   help="Scale Q*K^T by 1/layer-number (fp16 stability).")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Selective activation recompute (shorthand for --recompute-granularity selective).")
    g.add_argument("--recompute-granularity", type=str, default=None, choices=["full", "selective"],
                   help="Activation recompute granularity.")
    g.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"],
                   help="Full recompute method.")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="Layers per recompute unit.")
    g.add_argument("--recompute-modules", nargs="*", type=str, default=None,
                   help="Submodules recomputed under --recompute-granularity selective: core_attn (default), "
                        "mlp (dense MLPs), moe (MoE layers: router, exchange and experts), layernorm.")
    g.add_argument("--moe-layer-recompute", action="store_true",
                   help="Deprecated spelling of --recompute-granularity selective --recompute-modules moe (added "
                        "to the modules given).")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="Chunked cross entropy on 16-bit logits (no fp32 [s, b, vocab] copies); already the default "
                        "for 16-bit logits on CUDA, where it gives the eager loss's numbers.")
    g.add_argument("--torch-compile", action="store_true",
                   help="torch.compile each transformer layer (CUDA with Triton; eager elsewhere).")
    g.add_argument("--cuda-graph-impl", type=str, default="none",
                   choices=["none", "local", "transformer_engine", "full_iteration"],
                   help="CUDA graphs. full_iteration captures the forward and backward of all micro-batches of a "
                        "training step in one graph and replays it (data, tensor, pipeline and context parallel; "
                        "MoE with every expert local, or over several ranks when padded to capacity with the "
                        "alltoall dispatcher; what is refused and why: docs/migrating.md); the per-layer graphs of "
                        "local / transformer_engine are not built for training. In the generation tools any value "
                        "but none turns on the engine's CUDA graph of the whole decode step.")
    g.add_argument("--cuda-graph-scope", type=str, nargs="+", default=None,
                   help="With --cuda-graph-impl local: full_iteration selects whole-iteration graphs; the "
                        "per-layer scopes are not built for training. In the generation tools any scope "
                        "(full_iteration_inference included) turns on the whole decode step's CUDA graph.")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="Eager training steps before the CUDA graph is captured.")
    g.add_argument("--enable-cuda-graph", action="store_true",
                   help="Deprecated spelling of --cuda-graph-impl local (generation: decode CUDA graphs).")
    g.add_argument("--external-cuda-graph", action="store_true",
                   help="Deprecated spelling of --cuda-graph-impl transformer_engine.")
    return parser


def add_regularization_args(parser):
    g = parser.add_argument_group(title="regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout after the attention softmax.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout on the residual branches.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Decoupled weight decay.")
    g.add_argument("--start-weight-decay", type=float, default=None, help="Weight decay at the start.")
    g.add_argument("--end-weight-decay", type=float, default=None, help="Weight decay at the end.")
    g.add_argument("--weight-decay-incr-style", type=str, default="constant",
                   choices=["constant", "linear", "cosine"], help="Weight decay schedule.")
    g.add_argument("--apply-wd-to-qk-layernorm", action="store_true",
                   help="Weight decay on the q/k layernorm weights too (Qwen3-Next's rule); other 1-D params and "
                        "biases keep none.")
    g.add_argument("--no-weight-decay-cond-type", type=str, default=None, choices=["apply_wd_to_qk_layernorm"],
                   help="Deprecated spelling of --apply-wd-to-qk-layernorm.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global L2 gradient clip (0 disables).")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-08, help="Adam epsilon.")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    return parser


def add_initialization_args(parser):
    g = parser.add_argument_group(title="initialization")
    g.add_argument("--seed", type=int, default=1234, help="Random seed (python, numpy, torch, data).")
    g.add_argument("--data-parallel-random-init", action="store_true",
                   help="Different initial weights on each data-parallel rank.")
    g.add_argument("--cpu-offloading-num-layers", type=int, default=0,
                   help="Keep the activations the first N transformer layers save for the backward in host memory "
                        "(copied out in the forward, back in the backward); N < --num-layers, one pipeline stage, "
                        "no activation recompute.")
    g.add_argument("--init-model-with-meta-device", action="store_true",
                   help="Allocate the layers' weights on the meta device and fill each once on the model's device "
                        "(no first random draw): the same weights as without the flag, a faster start for large "
                        "models.")
    g.add_argument("--embedding-init-method-std", type=float, default=None,
                   help="Std of the normal init of the word, position and token-type embeddings (default "
                        "--init-method-std); around 1.0 may avoid loss spikes.")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="Std of the normal init; output projections use std/sqrt(2*num_layers).")
    g.add_argument("--init-method-xavier-uniform", action="store_true", help="Xavier-uniform init.")
    return parser


def add_mixed_precision_args(parser):
    g = parser.add_argument_group(title="mixed precision")
    g.add_argument("--fp16", action="store_true", help="fp16 params and compute, fp32 main weights.")
    g.add_argument("--bf16", action="store_true", help="bf16 params and compute, fp32 main weights.")
    g.add_argument("--disable-bf16-reduced-precision-matmul", action="store_true",
                   help="With --bf16: bf16 GEMMs accumulate split-K partial sums in fp32 only (torch's "
                        "allow_bf16_reduced_precision_reduction off), for numerics closer to fp32 at some speed.")
    g.add_argument("--loss-scale", type=float, default=None, help="Static loss scale (default: dynamic).")
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32, help="Initial dynamic loss scale.")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic loss scale.")
    g.add_argument("--loss-scale-window", type=float, default=1000, help="Clean steps before scaling up.")
    g.add_argument("--hysteresis", type=int, default=2, help="Overflows tolerated before scaling down.")
    g.add_argument("--fp32-residual-connection", action="store_true", help="Keep the residual stream in fp32.")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="Accumulate and all-reduce gradients in fp32 (on automatically with bf16).")
    g.add_argument("--grad-reduce-in-bf16", action="store_true", help="Reduce gradients in bf16.")
    g.add_argument("--fp16-lm-cross-entropy", action="store_true", help="Cross entropy in fp16.")
    g.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"], dest="fp8",
                   help="FP8 GEMMs in the transformer layers' linears (torch._scaled_mm, no Transformer "
                        "Engine): e4m3 everywhere, or hybrid = e4m3 forward, e5m2 gradients.")
    g.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "delayed", "mxfp8", "blockwise"],
                   help="FP8 scaling recipe; only tensorwise (per-tensor current scaling) is supported.")
    g.add_argument("--fp8-margin", type=int, default=0, help="Scale FP8 tensors to max / 2**margin.")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="Delayed-recipe amax history; must stay 1 (tensorwise only).")
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
                   help="Delayed-recipe amax reduction; must stay most_recent (tensorwise only).")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="With --fp8-format: the first and last transformer layers keep 16-bit linears.")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                   help="--first-last-layers-bf16: how many of the first layers stay 16-bit.")
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                   help="--first-last-layers-bf16: how many of the last layers stay 16-bit.")
    return parser
