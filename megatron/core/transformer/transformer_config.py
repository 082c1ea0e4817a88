"""TransformerConfig: architecture fields with Megatron's names, validated at construction."""
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core._compat_fields import check_compat_fields
from megatron.core.activations import squared_relu
from megatron.core.context_parallel.utils import CP_COMM_TYPES
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer._compat_fields import TransformerConfigCompat
from megatron.core.transformer.activation_offload import check_offloading
from megatron.core.transformer.attention_sinks import SOFTMAX_TYPES
from megatron.core.transformer.moe.config_checks import check_moe_config
from megatron.core.transformer.mup import apply_mup
from megatron.core.transformer.no_rope import no_rope_pattern
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.window_attention import check_window_attn_skip_freq
from megatron.core.utils import init_method_normal, scaled_init_method_normal


def check_attention_variant(variant: Optional[str], linear_attention_freq, num_layers: Optional[int],
                            multi_latent_attention: bool) -> Optional[str]:
    """--experimental-attention-variant and --linear-attention-freq as a GPT model builds them (the config's and the
    flags' one-line errors); the variant under its 0.19.2 name ("gdn", Megatron's newer name, becomes
    "gated_delta_net"). ``num_layers`` None: the pattern's length is checked later."""
    if variant == "gdn":
        variant = "gated_delta_net"
    if variant is None:
        if linear_attention_freq is not None:
            raise ValueError("--linear-attention-freq places linear attention layers: add "
                             "--experimental-attention-variant gated_delta_net")
        return None
    if variant != "gated_delta_net":
        raise NotImplementedError(f"--experimental-attention-variant {variant} is not supported yet: "
                                  "gated_delta_net is built")
    if linear_attention_freq is None:
        raise ValueError("--experimental-attention-variant gated_delta_net needs --linear-attention-freq (an int N: "
                         "N - 1 linear layers per softmax-attention layer, or a 0/1 list per layer, 1 = linear)")
    if num_layers is not None:
        linear_attention_pattern(linear_attention_freq, num_layers)  # one line if malformed
    if multi_latent_attention:
        raise NotImplementedError("--experimental-attention-variant gated_delta_net with --multi-latent-attention is "
                                  "not built: drop one")
    return variant


def linear_attention_pattern(linear_attention_freq, num_layers: int) -> List[int]:
    """[1 if layer i is a linear-attention layer else 0 for i in range(num_layers)] from Megatron's
    --linear-attention-freq: an int N (layer i keeps softmax attention where (i + 1) % N == 0) or a 0/1 list."""
    if isinstance(linear_attention_freq, int):
        if linear_attention_freq < 1:
            raise ValueError(f"--linear-attention-freq ({linear_attention_freq}) must be >= 1")
        return [0 if (i + 1) % linear_attention_freq == 0 else 1 for i in range(num_layers)]
    pattern = list(linear_attention_freq)
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ValueError(f"--linear-attention-freq pattern {pattern} must list one 1 (linear attention) or 0 "
                         f"(softmax attention) per layer ({num_layers} layers)")
    return pattern


@dataclass
class TransformerConfig(ModelParallelConfig, TransformerConfigCompat):
    """Architecture of a transformer stack (plus the parallel settings it inherits)."""

    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    fp32_residual_connection: bool = False
    apply_residual_connection_post_layernorm: bool = False
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    gated_linear_unit: bool = False
    activation_func: Callable = F.gelu
    activation_func_fp8_input_store: bool = False
    qk_layernorm: bool = False
    attention_output_gate: bool = False  # self-attention output * sigmoid(gate), gate from linear_qkv (Qwen3-Next)
    # QK-clip (MuonClip, Megatron's fields): after each optimizer step, the query and key rows of linear_qkv of a
    # query group whose max pre-softmax logit exceeded the threshold are scaled by eta^alpha and eta^(1 - alpha),
    # eta = threshold / max logit (megatron/core/optimizer/qk_clip.py). Either flag records the max logit.
    qk_clip: bool = False
    qk_clip_alpha: float = 0.5
    qk_clip_threshold: float = 100
    log_max_attention_logit: bool = False
    test_mode: bool = False
    calculate_per_token_loss: bool = False
    window_size: Optional[Tuple[int, int]] = None
    # The layers window_size applies to: every N-th layer attends fully, or a 0/1 list (window_attention.py)
    window_attn_skip_freq: Optional[Union[int, List[int]]] = None
    # The layers that skip RoPE (NoPE): every N-th layer, or a 0/1 list; kept as the 0/1 list (no_rope.py)
    no_rope_freq: Optional[Union[int, List[int]]] = None
    # Attention sinks: vanilla, off-by-one (a sink logit 0 per head) or learnable (attention_sinks.py)
    softmax_type: str = "vanilla"
    rotary_interleaved: bool = False
    # Multimodal RoPE (--position-embedding-type mrope): rotary frequency bands per (temporal, height, width)
    # position component; sums to the rotary dim / 2 (Qwen2-VL: [16, 24, 24]).
    mrope_section: Optional[List[int]] = None

    # Pipeline layer split
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # Each (virtual) stage's layers written out (--pipeline-model-parallel-layout): a string, a list of
    # stages, or a parsed PipelineParallelLayerLayout; replaces the counts above.
    pipeline_model_parallel_layout: Optional[Union[str, list, PipelineParallelLayerLayout]] = None

    # Context parallelism (megatron/core/context_parallel): one comm type for every layer, or one per layer
    cp_comm_type: Optional[Union[str, List[str]]] = None

    # Initialization
    init_method: Optional[Callable] = None
    output_layer_init_method: Optional[Callable] = None
    init_method_std: float = 0.02
    embedding_init_method: Optional[Callable] = None  # the word, position and token-type embeddings' init
    embedding_init_method_std: Optional[float] = None  # its std (default --init-method-std)
    softmax_scale: Optional[float] = None  # the attention scores' scale (default 1/sqrt(kv_channels))
    # bf16 GEMMs accumulate their split-K partial sums in fp32 only (torch's process-wide cuBLAS setting, as Megatron)
    disable_bf16_reduced_precision_matmul: bool = False
    # Maximal Update Parameterization (mup.py): the base width, the multipliers and the attention-scale power
    use_mup: bool = False
    mup_width_mult: float = 1.0  # computed: hidden_size / mup_base_hidden_size
    mup_base_hidden_size: Optional[int] = None
    mup_embedding_mult: float = 1.0
    mup_output_mult: float = 1.0
    mup_base_head_dim: Optional[float] = None
    mup_attn_scale_power: float = 1.0

    # Mixed precision / fusions
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True
    bias_activation_fusion: bool = False
    masked_softmax_fusion: bool = False
    persist_layer_norm: bool = False
    memory_efficient_layer_norm: bool = False
    bias_dropout_fusion: bool = False
    apply_rope_fusion: bool = False
    attention_backend: str = "auto"
    cross_entropy_loss_fusion: bool = False

    # Activation recompute
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[List[str]] = None
    distribute_saved_activations: Optional[bool] = False

    # MoE (megatron/core/transformer/moe): Megatron's field names and defaults
    num_moe_experts: Optional[int] = None
    moe_layer_freq: Union[int, List[int]] = 1
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_overlap: bool = False
    moe_shared_expert_gate: bool = False  # sigmoid gate on the shared experts' output (Qwen2-MoE)
    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"
    moe_router_topk: int = 2
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_score_function: str = "softmax"
    moe_router_dtype: Optional[str] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_grouped_gemm: bool = False
    moe_aux_loss_coeff: Union[float, List[float]] = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_input_jitter_eps: Optional[float] = None
    moe_token_dispatcher_type: str = "allgather"
    moe_per_layer_logging: bool = False
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_permute_fusion: bool = False
    moe_router_fusion: bool = False
    moe_apply_probs_on_input: bool = False  # scale the expert input by the prob (top-1), not its activation
    # Latent MoE (Nemotron 3's): the routed experts work in a moe_latent_size-wide space; the layer projects the
    # tokens down before the dispatch and the combined output back up (the router and shared expert see h).
    moe_latent_size: Optional[int] = None
    # GLU: activation(gate) * (up + glu_linear_offset); with activation_func_clamp_value, gate <= clamp and
    # |up| <= clamp first (gpt-oss's clamped GLU; activations.glu)
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None
    # The experts' squared-ReLU activation times the routing prob in one fp32 kernel (fusions/weighted_squared_relu.py)
    use_fused_weighted_squared_relu: bool = False
    moe_router_force_load_balancing: bool = False  # random router logits: balanced load for benchmarks
    moe_router_force_biased: Optional[float] = None  # random logits + a shared per-expert bias of this std

    # Query/key L2 norm (Llama 4): chosen by the layer spec (get_gpt_layer_*_spec(qk_l2_norm=True))
    qk_l2_norm: bool = False

    # Multi-latent attention (shapes in MLATransformerConfig) and multi-token prediction
    multi_latent_attention: bool = False
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1
    mtp_use_repeated_layer: bool = False
    """One MTP layer applied at every depth (its weights shared by the mtp_num_layers predictions)."""

    # FP8 linears without Transformer Engine (megatron/core/fp8): format e4m3 | hybrid, tensorwise
    # current scaling. The amax-history fields belong to the delayed recipe and must keep their defaults.
    fp8: Optional[str] = None
    fp8_recipe: str = "tensorwise"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    # --first-last-layers-bf16: the first / last transformer layers (counts below) keep 16-bit linears under FP8.
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1

    # Deterministic mode (--deterministic-mode): core attention uses deterministic SDPA kernels only.
    deterministic_mode: bool = False
    # --init-model-with-meta-device: layers allocate their weights on the meta device; the model then materializes
    # them on its device and fills each once from (seed, global name), the values of a normal build.
    init_model_with_meta_device: bool = False

    # Hybrid models (megatron/core/models/hybrid, megatron/core/ssm): Mamba-2 and Gated DeltaNet shapes
    is_hybrid_model: bool = False
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: Optional[int] = None
    linear_conv_kernel_dim: Optional[int] = 4
    linear_key_head_dim: Optional[int] = 128
    linear_value_head_dim: Optional[int] = 128
    linear_num_key_heads: Optional[int] = 16
    linear_num_value_heads: Optional[int] = 32
    # Linear attention inside a GPT model (Qwen3-Next): "gated_delta_net" makes the layers that
    # linear_attention_freq marks Gated DeltaNet layers (an int N: every N-th layer, from layer N - 1, keeps
    # softmax attention and the others are linear; a 0/1 list: 1 = linear), their MLP or MoE unchanged.
    experimental_attention_variant: Optional[str] = None
    linear_attention_freq: Optional[Union[int, List[int]]] = None

    def __post_init__(self):
        super().__post_init__()
        check_compat_fields(self, TransformerConfigCompat, inert=self._inert_field)
        self._check_shapes()
        self._check_features()
        self._check_recompute()
        self._check_pipeline_split()
        if self.bf16 and self.disable_bf16_reduced_precision_matmul:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        if self.use_mup:  # before the init methods below: MuP scales them with width
            apply_mup(self)
        # The embeddings' init (Megatron's rule): --embedding-init-method-std when it differs from --init-method-std
        # (e.g. 1.0 against loss spikes), else the layers' init method itself.
        if self.embedding_init_method_std is None:
            self.embedding_init_method_std = self.init_method_std
        if self.embedding_init_method is None and (self.init_method is None
                                                   or self.embedding_init_method_std != self.init_method_std):
            self.embedding_init_method = init_method_normal(self.embedding_init_method_std)
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.embedding_init_method is None:
            self.embedding_init_method = self.init_method
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)

    def _inert_field(self, name: str) -> bool:
        """Fields Megatron reads only when their feature is on: moe_* without experts, mtp_* without
        MTP layers. Any value there gives the same (dense, no-MTP) model."""
        return ((name.startswith("moe_") and self.num_moe_experts is None)
                or (name.startswith("mtp_") and getattr(self, "mtp_num_layers", None) is None))

    def _check_offloading(self):
        if self.cpu_offloading_num_layers > 0:
            self.cpu_offloading = True
        if not self.cpu_offloading:
            return
        if not self.cpu_offloading_activations:
            raise ValueError("cpu_offloading without cpu_offloading_activations offloads nothing here (weights stay "
                             "on the device); leave cpu_offloading_activations on")
        check_offloading(self.cpu_offloading_num_layers, self.num_layers, self.pipeline_model_parallel_size,
                         self.recompute_granularity)

    def _check_attention_variant(self):
        self.experimental_attention_variant = check_attention_variant(
            self.experimental_attention_variant, self.linear_attention_freq, self.num_layers,
            self.multi_latent_attention)

    def _check_shapes(self):
        for name in ("num_layers", "num_attention_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransformerConfig.{name} must be > 0, got {getattr(self, name)}")
        # hidden_size keeps Megatron's default 0 at construction (configs filled in later, e.g. by
        # dataclasses.replace); a model refuses it when it is built (TransformerBlock).
        if self.hidden_size < 0:
            raise ValueError(f"TransformerConfig.hidden_size must be > 0, got {self.hidden_size}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                                 f"({self.num_attention_heads}) unless kv_channels is set")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"num_query_groups ({self.num_query_groups})")
        tp = self.tensor_model_parallel_size
        if self.num_attention_heads % tp != 0:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"tensor_model_parallel_size ({tp})")
        if self.num_query_groups % tp != 0:
            raise ValueError(f"num_query_groups ({self.num_query_groups}) must be divisible by "
                             f"tensor_model_parallel_size ({tp})")
        if self.ffn_hidden_size % tp != 0:
            raise ValueError(f"ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by "
                             f"tensor_model_parallel_size ({tp})")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got '{self.normalization}'")

    def _check_features(self):
        if self.num_moe_experts is not None:
            check_moe_config(self)
        self._check_attention_variant()
        self._check_offloading()
        self._check_fp8()
        self._check_context_parallel()
        self._check_mtp()
        self._check_qk_clip()
        if self.window_size is not None:
            self.window_size = tuple(int(x) for x in self.window_size)
            if len(self.window_size) != 2 or min(self.window_size) < -1:
                raise ValueError(f"--window-size {self.window_size}: expected (left, right), each >= 0 or -1")
        check_window_attn_skip_freq(self.window_size, self.window_attn_skip_freq, self.num_layers)
        self.no_rope_freq = no_rope_pattern(self.no_rope_freq, self.num_layers)
        if self.no_rope_freq and getattr(self, "multi_latent_attention", False):
            raise ValueError("--no-rope-freq is not supported with multi-latent attention (its layers keep their "
                             "own rotary embedding)")
        if self.softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"--softmax-type {self.softmax_type}: use one of {', '.join(SOFTMAX_TYPES)}")
        backend = getattr(self.attention_backend, "name", self.attention_backend)  # AttnBackend or str
        if backend not in ("auto", "local", "flash", "fused", "unfused"):
            raise ValueError(f"attention_backend '{self.attention_backend}' unknown; use auto, local, "
                             "flash, fused or unfused")
        if self.apply_query_key_layer_scaling:
            # Scaling Q.K by 1/layer_number and the softmax back up is a pure fp16 overflow guard.
            self.attention_softmax_in_fp32 = True
        if self.fp32_residual_connection and (self.fp16 or self.bf16):
            raise NotImplementedError("--fp32-residual-connection with --fp16/--bf16 is not supported yet; "
                                      "drop the flag")
        if self.activation_func_fp8_input_store:
            raise NotImplementedError("--activation-func-fp8-input-store needs FP8 support; drop the flag")
        if (self.glu_linear_offset or self.activation_func_clamp_value is not None) and not self.gated_linear_unit:
            raise ValueError("--glu-linear-offset / --activation-func-clamp-value shape a gated linear unit: they "
                             "need --swiglu or --quick-geglu")
        if self.activation_func_clamp_value is not None and not self.activation_func_clamp_value > 0:
            raise ValueError(f"--activation-func-clamp-value must be > 0, got {self.activation_func_clamp_value}")
        if self.use_fused_weighted_squared_relu:
            if self.activation_func is not squared_relu or self.gated_linear_unit or self.num_moe_experts is None:
                raise ValueError("--use-fused-weighted-squared-relu fuses the MoE experts' squared-ReLU activation "
                                 "with the routing probability: it needs --squared-relu (no --swiglu) and "
                                 "--num-experts")

    def _check_qk_clip(self):
        if not self.qk_clip:
            return
        if not 0.0 < self.qk_clip_alpha < 1.0:
            raise ValueError(f"--qk-clip-alpha must be between 0 and 1 (exclusive), got {self.qk_clip_alpha}")
        if not self.qk_clip_threshold > 0:
            raise ValueError(f"--qk-clip-threshold must be > 0, got {self.qk_clip_threshold}")

    def _check_context_parallel(self):
        if isinstance(self.cp_comm_type, list) and len(self.cp_comm_type) == 1:
            self.cp_comm_type = self.cp_comm_type[0]  # Megatron's one-value list: every layer
        types = self.cp_comm_type if isinstance(self.cp_comm_type, list) else [self.cp_comm_type or "p2p"]
        if isinstance(self.cp_comm_type, list) and len(types) != self.num_layers:
            raise ValueError(f"--cp-comm-type has {len(types)} entries; give one, or one per layer "
                             f"(--num-layers {self.num_layers})")
        for t in types:
            if t not in CP_COMM_TYPES:
                raise ValueError(f"--cp-comm-type '{t}' unknown; use one of {', '.join(CP_COMM_TYPES)}")
        self._check_hierarchical_context_parallel("a2a+p2p" in types)
        if self.context_parallel_size == 1:
            return
        backend = getattr(self.attention_backend, "name", self.attention_backend)
        if backend in ("unfused", "fused"):
            raise ValueError(f"--attention-backend {backend} has no log-sum-exp path here, which "
                             "--context-parallel-size > 1 needs to merge partial attention; use auto or flash")
        if self.attention_dropout > 0:
            raise NotImplementedError("--attention-dropout > 0 with --context-parallel-size > 1 is not "
                                      "supported; pass --attention-dropout 0")

    def _check_hierarchical_context_parallel(self, used: bool):
        """a2a+p2p splits CP into [a2a size, p2p size] (Megatron's hierarchical_context_parallel_sizes)."""
        sizes = self.hierarchical_context_parallel_sizes
        if not sizes:
            if used:
                raise ValueError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P "
                                 "(all-to-all size, ring size; A x P = --context-parallel-size)")
            return
        if any(int(x) < 1 for x in sizes) or math.prod(sizes) != self.context_parallel_size:
            raise ValueError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} must be positive "
                             f"and multiply to --context-parallel-size ({self.context_parallel_size})")
        if not used:
            return
        if len(sizes) != 2:
            raise ValueError(f"--cp-comm-type a2a+p2p takes two --hierarchical-context-parallel-sizes (all-to-all "
                             f"size, ring size), got {len(sizes)}")
        heads = self.num_attention_heads // self.tensor_model_parallel_size
        if heads % sizes[0]:
            raise ValueError(f"--cp-comm-type a2a+p2p splits the {heads} attention heads per TP rank over the "
                             f"all-to-all size {sizes[0]} (first --hierarchical-context-parallel-sizes value), "
                             "which must divide them")

    def cp_comm_type_of_layer(self, layer_number: int) -> str:
        """The comm type of 1-based global ``layer_number``."""
        if isinstance(self.cp_comm_type, list):
            return self.cp_comm_type[layer_number - 1]
        return self.cp_comm_type or "p2p"

    def _check_mtp(self):
        if self.mtp_num_layers is None:
            return
        if self.mtp_num_layers < 1:
            raise ValueError(f"--mtp-num-layers ({self.mtp_num_layers}) must be >= 1")
        if self.context_parallel_size > 1:
            raise NotImplementedError("--mtp-num-layers with --context-parallel-size > 1 is not supported yet")
        if self.pipeline_model_parallel_size > 1:
            raise NotImplementedError("--mtp-num-layers with --pipeline-model-parallel-size > 1 is not supported "
                                      "(the MTP layers need the word embedding on the last stage); use PP=1")

    def is_bf16_layer(self, layer_number: int) -> bool:
        """Whether transformer layer ``layer_number`` (global, from 1) keeps 16-bit linears under FP8
        (--first-last-layers-bf16: the first and last layers, whose activations FP8 hurts most)."""
        if not (self.fp8 and self.first_last_layers_bf16):
            return False
        return (layer_number <= self.num_layers_at_start_in_bf16
                or layer_number > self.num_layers - self.num_layers_at_end_in_bf16)

    def _check_fp8(self):
        if self.fp8 is None:
            return
        if self.fp8 not in ("e4m3", "hybrid"):
            raise ValueError(f"--fp8-format '{self.fp8}' unknown; use e4m3 or hybrid")
        if self.fp8_recipe != "tensorwise":
            raise NotImplementedError(f"--fp8-recipe {self.fp8_recipe} is not supported (no Transformer Engine); "
                                      "use --fp8-recipe tensorwise")
        if self.fp8_amax_history_len != 1 or self.fp8_amax_compute_algo != "most_recent":
            raise NotImplementedError("--fp8-amax-history-len / --fp8-amax-compute-algo belong to the delayed "
                                      "recipe, which is not supported; drop them (tensorwise scales each tensor "
                                      "by its current amax)")
        if self.first_last_layers_bf16 and (self.num_layers_at_start_in_bf16 < 0 or self.num_layers_at_end_in_bf16 < 0):
            raise ValueError("--num-layers-at-start-in-bf16 and --num-layers-at-end-in-bf16 must be >= 0")
        if self.fp8_margin < 0:
            raise ValueError(f"--fp8-margin ({self.fp8_margin}) must be >= 0")

    def _check_recompute(self):
        g = self.recompute_granularity
        if g not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity must be None, 'full' or 'selective', got '{g}'")
        if g == "full":
            if self.recompute_method not in ("uniform", "block"):
                raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
            if not self.recompute_num_layers:
                raise ValueError("--recompute-granularity full needs --recompute-num-layers >= 1")
        elif self.recompute_method is not None:
            raise ValueError("--recompute-method needs --recompute-granularity full")
        if g == "selective":
            if self.recompute_modules is None:
                self.recompute_modules = ["core_attn"]
            bad = set(self.recompute_modules) - {"core_attn", "mlp", "moe", "layernorm"}
            if bad:
                raise NotImplementedError(f"--recompute-modules {sorted(bad)} not supported; use core_attn, "
                                          "mlp (dense MLPs), moe (MoE layers), layernorm")
        if self.distribute_saved_activations:
            raise NotImplementedError("--distribute-saved-activations is not supported yet; drop the flag")

    def _check_pipeline_split(self):
        uneven = (self.num_layers_in_first_pipeline_stage is not None
                  or self.num_layers_in_last_pipeline_stage is not None)
        layout = self.pipeline_model_parallel_layout
        if layout is not None:
            if uneven or self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split:
                raise ValueError("--pipeline-model-parallel-layout places every layer itself: drop "
                                 "--decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-split")
            if not isinstance(layout, PipelineParallelLayerLayout):
                layout = PipelineParallelLayerLayout(layout, self.pipeline_model_parallel_size)
            elif layout.pipeline_model_parallel_size != self.pipeline_model_parallel_size:
                raise ValueError(f"the pipeline layout is for {layout.pipeline_model_parallel_size} pipeline ranks, "
                                 f"pipeline_model_parallel_size is {self.pipeline_model_parallel_size}")
            layout.validate_layer_layout(self.num_layers, getattr(self, "mtp_num_layers", None))
            vp = layout.virtual_pipeline_model_parallel_size
            if self.virtual_pipeline_model_parallel_size is None and vp > 1:
                self.virtual_pipeline_model_parallel_size = vp  # the layout's entries set it
            if (self.virtual_pipeline_model_parallel_size or 1) != vp:
                raise ValueError(f"the pipeline layout has {vp} virtual stage(s) per pipeline rank, "
                                 f"virtual_pipeline_model_parallel_size is {self.virtual_pipeline_model_parallel_size}")
            self.pipeline_model_parallel_layout = layout
        if uneven and (self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split):
            raise ValueError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                             "--account-for-embedding/loss-in-pipeline-split")
        if self.pipeline_model_parallel_size == 1 and uneven:
            raise ValueError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")


@dataclass
class MLATransformerConfig(TransformerConfig):
    """A TransformerConfig for multi-latent attention (DeepSeek-V2/V3): low-rank query and key/value
    projections, a decoupled RoPE part of each query/key head, and YaRN or plain RoPE."""

    multi_latent_attention: bool = True
    q_lora_rank: Optional[int] = 512  # None: queries come from one full-rank projection (linear_q_proj)
    kv_lora_rank: Optional[int] = 512
    qk_head_dim: int = 128  # per-head query/key dims without position embedding
    qk_pos_emb_head_dim: int = 64  # per-head query/key dims that carry RoPE (shared by all heads for keys)
    v_head_dim: int = 128
    normalization: str = "RMSNorm"
    rope_type: str = "yarn"  # "yarn" or "rope"
    rotary_base: float = 10000
    rotary_percent: float = 1.0
    rotary_scaling_factor: float = 40
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    correction_range_round_to_int: bool = True
    cache_mla_latents: bool = False
    mla_down_proj_fusion: bool = False  # one fused q+kv down projection (Transformer Engine): refused

    def __post_init__(self):
        if self.kv_channels is None:  # unused by MLA; keeps hidden % heads from mattering
            self.kv_channels = self.v_head_dim
        super().__post_init__()
        if self.qk_clip:
            raise NotImplementedError("--qk-clip with --multi-latent-attention is not supported yet (QK-clip "
                                      "rescales linear_qkv); drop --qk-clip (--log-max-attention-logit works)")
        if self.kv_lora_rank is None or self.kv_lora_rank < 1:
            raise ValueError(f"--kv-lora-rank (kv_lora_rank={self.kv_lora_rank}) must be set to a positive "
                             "rank with --multi-latent-attention")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"--q-lora-rank ({self.q_lora_rank}) must be positive, or unset for a full-rank "
                             "query projection")
        for name in ("qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} ({getattr(self, name)}) must be >= 1")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"--qk-pos-emb-head-dim ({self.qk_pos_emb_head_dim}) must be even (RoPE rotates pairs)")
        if self.rope_type not in ("rope", "yarn"):
            raise ValueError(f"--rope-type '{self.rope_type}' unknown for multi-latent attention; use rope or yarn")
        if self.context_parallel_size > 1:
            raise NotImplementedError("--multi-latent-attention with --context-parallel-size > 1 is not supported yet")
        if self.cache_mla_latents:
            raise NotImplementedError("--cache-mla-latents belongs to the dynamic inference engine; drop the flag")
        if self.mla_down_proj_fusion:
            raise NotImplementedError("--mla-down-proj-fusion (one fused q+kv down projection) needs Transformer "
                                      "Engine; drop the flag")
        if self.num_query_groups != self.num_attention_heads:
            raise ValueError("--group-query-attention cannot be combined with --multi-latent-attention")
        tp = self.tensor_model_parallel_size
        # The down projections are column-parallel (Megatron's local spec), so their widths split over TP.
        for what, width in (("--q-lora-rank", self.q_lora_rank),
                            ("--kv-lora-rank + --qk-pos-emb-head-dim", self.kv_lora_rank + self.qk_pos_emb_head_dim)):
            if width is not None and width % tp:
                raise ValueError(f"{what} ({width}) must be divisible by --tensor-model-parallel-size ({tp})")
