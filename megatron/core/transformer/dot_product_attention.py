"""softmax(Q K^T / sqrt(d) + mask) V for the local heads, through torch's scaled_dot_product_attention."""
from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core import parallel_state
from megatron.core.context_parallel.kernels import (  # noqa: F401  (tests read _CUDNN_GQA)
    _CUDNN_GQA,
    cudnn_gqa_usable,
    cudnn_narrow_v_attention,
    cudnn_narrow_v_usable,
)
from megatron.core.context_parallel.kernels import cudnn_gqa_attention as _cudnn_gqa_attention
from megatron.core.context_parallel.utils import document_layout
from megatron.core.process_groups_config import get_pg, get_pg_size
from megatron.core.tensor_parallel.layers import _make_param, set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.attention_sinks import with_sink
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.max_logit import context_parallel_max_attention_logit, max_attention_logit
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.window_attention import is_layer_window_attention

# --attention-backend -> SDPA kernels, in priority order (CUDA only; CPU keeps torch's choice).
# flash: FlashAttention-2; fused: cuDNN's fused attention, then the memory-efficient kernel;
# unfused: the math path (explicit softmax); auto/local: cuDNN, then flash, then the others.
_SDPA_BACKENDS = {
    "flash": ("FLASH_ATTENTION",),
    "fused": ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"),
    "unfused": ("MATH",),
    "auto": ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
    "local": ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
}

# Under --deterministic-mode (torch.use_deterministic_algorithms): flash and memory-efficient attention
# switch to deterministic backward passes (measured bitwise on H200, torch 2.11); cuDNN attention has none.
_NONDETERMINISTIC = ("CUDNN_ATTENTION",)
_MASKED_DETERMINISTIC = ("EFFICIENT_ATTENTION", "MATH")  # flash takes no explicit mask


def _cudnn_first(backends) -> bool:
    """cuDNN heads the allowed backends (so never under deterministic mode): the direct cuDNN calls below (GQA at
    the K/V head count, MLA at the value's head dim) may replace SDPA's dispatch."""
    return bool(backends) and backends[0] == SDPBackend.CUDNN_ATTENTION


def sdpa_backends(attention_backend: str, deterministic: bool = False):
    """The ``torch.nn.attention.SDPBackend`` list for a Megatron ``--attention-backend`` value."""
    names = [n for n in _SDPA_BACKENDS[str(attention_backend)] if not (deterministic and n in _NONDETERMINISTIC)]
    return [getattr(SDPBackend, name) for name in names or ("MATH",)]


def masked_sdpa_backends(deterministic: bool):
    """Kernels for an explicit mask: torch's choice, or the deterministic ones in deterministic mode."""
    return [getattr(SDPBackend, name) for name in _MASKED_DETERMINISTIC] if deterministic else None


def _sdpa_context(backends, device):
    if device.type != "cuda" or backends is None:
        return nullcontext()
    return sdpa_kernel(backends, set_priority=True)


def sliding_window_mask(sq: int, sk: int, window, device) -> torch.Tensor:
    """[sq, sk] bool, True = attend: key j is visible from query i when i - left <= j <= i + right
    (Megatron's ``--window-size (left, right)``; -1 is unbounded). Queries are the last ``sq`` positions."""
    left, right = window
    i = torch.arange(sk - sq, sk, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


class DotProductAttention(MegatronModule):
    """Core attention on ``[s, b, np, hn]`` queries and ``[s, b, ng, hn]`` keys/values (GQA: ng <= np);
    values may have a smaller head dim than queries/keys (MLA).

    The mask is boolean with True = masked (Megatron's convention). A causal layer with no mask uses
    SDPA's ``is_causal`` path (flash / memory-efficient kernels); an explicit mask is passed as is.
    ``config.window_size`` (sliding window) adds a banded [s, s] mask, built once per shape and shared by
    all layers; SDPA then runs its masked kernels (memory-efficient on CUDA, not flash).
    ``pg_collection``: its ``tp`` group splits the heads and its ``cp`` group the sequence (``hcp``, the
    [a2a, p2p] pair, for ``a2a+p2p``; parallel_state's groups when None).

    With ``config.qk_clip`` or ``config.log_max_attention_logit``, a training forward of self-attention also
    records ``current_max_attn_logits`` (Megatron's name): the per-local-head max pre-softmax logit, the
    running max over the step's micro-batches, this rank's queries only (the DP x CP max is taken by
    `megatron.core.optimizer.qk_clip.clip_qk`, which also resets it).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **kwargs):
        super().__init__(config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if softmax_scale is None:  # the config's (MuP sets 1/d), else 1/sqrt(d)
            softmax_scale = getattr(config, "softmax_scale", None) or config.kv_channels ** -0.5
        self.softmax_scale = softmax_scale
        self.pg_collection = pg_collection
        tp = get_pg_size(pg_collection, "tp", "DotProductAttention")
        if pg_collection is not None and config.context_parallel_size > 1:
            get_pg(pg_collection, "cp", "DotProductAttention")  # missing: fail at build, not in forward
        self.num_heads_per_partition = config.num_attention_heads // tp
        self.num_groups_per_partition = config.num_query_groups // tp
        backend = getattr(config.attention_backend, "name", config.attention_backend)
        deterministic = getattr(config, "deterministic_mode", False)
        self.sdpa_backends = sdpa_backends(backend, deterministic)
        self.masked_sdpa_backends = masked_sdpa_backends(deterministic)
        # Sliding window on this layer (all layers, or those --window-attn-skip-freq leaves windowed)
        self.window_size = (config.window_size if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, self.layer_number) else None)
        # Attention sinks (--softmax-type): one sink logit per local head, fixed at 0 or learnt
        self.softmax_type = config.softmax_type
        if self.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(self.num_heads_per_partition), persistent=False)
        elif self.softmax_type == "learnable":
            # Megatron's init (config.init_method); the model redraws it per global name (transformer/initialize.py)
            self.softmax_offset = _make_param((self.num_heads_per_partition,), config, config.init_method)
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)  # split with the heads
        else:
            self.softmax_offset = None
        self.cp_comm_type = cp_comm_type or config.cp_comm_type_of_layer(self.layer_number)
        self.records_max_logit = attention_type == "self" and (config.qk_clip or config.log_max_attention_logit)
        self.current_max_attn_logits = None  # [np] fp32, see the class docstring
        if self.records_max_logit and _RECORD["eager"] is None:
            # Eager under --torch-compile: a graph break instead of guards on the attribute it rebinds every
            # step. Wrapped on first use, not decorated: torch.compiler.disable imports torch._dynamo (~2 s),
            # which runs without the flags need not pay.
            _RECORD["eager"] = torch.compiler.disable(_record_max_logit)
        if pg_collection is not None and config.context_parallel_size > 1 and self.cp_comm_type == "a2a+p2p":
            hcp = get_pg(pg_collection, "hcp", "DotProductAttention")
            if len(hcp) != 2 or hcp[0].size() * hcp[1].size() != config.context_parallel_size:
                raise ValueError("DotProductAttention: cp_comm_type a2a+p2p needs pg_collection.hcp = [a2a group, "
                                 f"p2p group] whose sizes multiply to context_parallel_size "
                                 f"({config.context_parallel_size})")

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("attention bias is not supported by local attention")
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type is AttnMaskType.causal_bottom_right:
            raise NotImplementedError("AttnMaskType.causal_bottom_right needs Transformer Engine attention")
        sq, b, np_, hn = query.shape
        cp_group = None
        if self.config.context_parallel_size > 1 and self.cp_comm_type == "a2a+p2p":
            cp_group = (parallel_state.get_hierarchical_context_parallel_groups() if self.pg_collection is None
                        else self.pg_collection.hcp)  # [a2a (inner), p2p (outer)]
        elif self.config.context_parallel_size > 1:
            cp_group = (parallel_state.get_context_parallel_group() if self.pg_collection is None
                        else self.pg_collection.cp)
        if self.records_max_logit and self.training:
            _RECORD["eager"](self, query, key, attention_mask, mask_type, cp_group is not None, packed_seq_params)
        if cp_group is not None or packed_seq_params is not None:
            return self._long_context(query, key, value, cp_group, packed_seq_params, mask_type)
        # [s, b, n, hn] -> [b, n, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        direct_cudnn = (_cudnn_first(self.sdpa_backends) and q.size(2) == k.size(2) and attention_mask is None
                        and dropout_p == 0.0 and self.window_size is None and self.softmax_offset is None
                        and mask_type in (AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding_causal))
        causal = mask_type is not AttnMaskType.no_mask
        if direct_cudnn and k.size(1) != q.size(1) and cudnn_gqa_usable(q, v):
            ctx = _cudnn_gqa_attention(q, k, v, causal, self.softmax_scale)
            if ctx is not None:
                return ctx.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
        if direct_cudnn and v.size(-1) < hn and cudnn_narrow_v_usable(q, v):
            # MLA: cuDNN at the value's own head dim, where the path below pads V to the query's for flash
            ctx = cudnn_narrow_v_attention(q, k, v, causal, self.softmax_scale)
            if ctx is not None:
                return ctx.permute(2, 0, 1, 3).reshape(sq, b, np_ * v.size(-1))
        if k.size(1) != q.size(1):
            rep = q.size(1) // k.size(1)
            k = k.repeat_interleave(rep, dim=1)  # [b, np, sk, hn]
            v = v.repeat_interleave(rep, dim=1)
        is_causal = attention_mask is None and mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        attn_mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        if self.window_size is not None:
            band = _cached_band(sq, k.size(2), self.window_size, q.device)
            if is_causal:
                band = band & _cached_band(sq, k.size(2), (-1, 0), q.device)
            attn_mask, is_causal = band if attn_mask is None else attn_mask & band, False
        # Heads are split over TP, so each rank needs its own dropout stream (no stream without dropout:
        # forking the RNG state would also break a compiled layer's graph for nothing).
        rng = get_cuda_rng_tracker().fork() if dropout_p > 0 else nullcontext()
        # An explicit mask (reset attention, padding) leaves the kernel choice to torch (flash takes none),
        # except in deterministic mode.
        backends = self.sdpa_backends if attn_mask is None else self.masked_sdpa_backends
        v_dim = v.size(-1)
        if self.softmax_offset is not None:
            q, k, v, attn_mask = with_sink(q, k, v, self.softmax_offset, self.softmax_scale, attn_mask, is_causal)
            is_causal, backends = False, self.masked_sdpa_backends
        elif v_dim < hn and q.is_cuda:
            # MLA: value heads narrower than query/key heads. The flash and cuDNN kernels want one head
            # dim, so pad V with zeros; the padded output columns are zero and dropped below.
            v = F.pad(v, (0, hn - v_dim))
        with rng, _sdpa_context(backends, q.device):
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                 is_causal=is_causal, scale=self.softmax_scale)
        ctx = ctx[..., :v_dim]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, np_ * v_dim)  # [s, b, np * hv]

    def _long_context(self, query, key, value, cp_group, packed_seq_params, mask_type):
        """Causal attention over the CP group's sequence and/or within packed documents (no dense mask)."""
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError("context parallelism and packed sequences need causal self-attention")
        if self.window_size is not None:
            raise NotImplementedError("--window-size (sliding-window attention) is not supported with context "
                                      "parallelism or packed sequences yet")
        if self.softmax_offset is not None:
            raise NotImplementedError(f"--softmax-type {self.softmax_type} (attention sinks) is not supported with "
                                      "context parallelism or packed sequences yet")
        if self.training and self.dropout_p > 0:
            raise NotImplementedError("attention dropout is not supported with context parallelism or packed "
                                      "sequences; pass --attention-dropout 0")
        sq, b, np_, hn = query.shape
        # Imported here: its @torch.compiler.disable pulls in torch._dynamo (~1.3 s per process start).
        from megatron.core.context_parallel.attention import long_context_attention  # lazy: torch._dynamo, ~1.3 s
        ctx = long_context_attention(query, key, value, self.softmax_scale, cp_group, self.cp_comm_type,
                                     packed_seq_params)  # [s, b, np, hn]
        return ctx.reshape(sq, b, np_ * hn)

_RECORD = {"eager": None}  # _record_max_logit under torch.compiler.disable, made when first needed


def _record_max_logit(core, query, key, attention_mask, mask_type, context_parallel, packed_seq_params):
    """Fold this micro-batch's per-head max logit into ``core.current_max_attn_logits`` (``core``: a
    DotProductAttention; the masks are those its forward applies)."""
    sq, b = query.shape[:2]
    if context_parallel:
        # The whole CP group (for a2a+p2p too): the max needs every key, whatever the attention's comm.
        group = (parallel_state.get_context_parallel_group() if core.pg_collection is None
                 else get_pg(core.pg_collection, "cp", "DotProductAttention"))
        cp = torch.distributed.get_world_size(group)
        layout = None if packed_seq_params is None else document_layout(packed_seq_params, b, sq * cp)
        m = context_parallel_max_attention_logit(query, key, core.softmax_scale, group, layout)
    elif packed_seq_params is not None:
        doc = document_layout(packed_seq_params, b, sq).doc
        m = max_attention_logit(query, key, core.softmax_scale, causal=True, q_doc=doc, k_doc=doc)
    else:
        causal = attention_mask is None and mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        m = max_attention_logit(query, key, core.softmax_scale, causal=causal, attention_mask=attention_mask,
                                window=core.window_size)
    prev = core.current_max_attn_logits
    core.current_max_attn_logits = m if prev is None else torch.maximum(prev, m)


_BANDS = {}


def _cached_band(sq, sk, window, device):
    """One mask per (shape, window, device), reused by every layer and step (at most a few shapes live)."""
    key = (sq, sk, tuple(window), str(device))
    if key not in _BANDS:
        if len(_BANDS) > 8:
            _BANDS.clear()
        _BANDS[key] = sliding_window_mask(sq, sk, window, device)
    return _BANDS[key]
