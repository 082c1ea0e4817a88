"""The local experts of an MoE layer, fed tokens already grouped by expert ([N, h], ``tokens_per_expert``).

- GroupedMLP: all local experts' weights in two stacked tensors; on Hopper-class GPUs in bf16 both
  GEMMs are one ``torch._grouped_mm`` each (no per-expert launch), elsewhere a loop over experts.
- SequentialMLP: one of our MLPs per expert (Megatron's local-spec experts), run in a loop.
- TEGroupedMLP: Megatron's Transformer Engine experts' name and constructor, built as a GroupedMLP (the
  grouped GEMM takes the place of TE's grouped linears).

Called with ``permuted_probs`` (each row's routing weight, Megatron's experts interface) the experts
scale each row's activation by it before fc2; our dispatchers apply the weights when combining instead.

Expert weights are split over the expert-TP group like a dense MLP (fc1 by columns, fc2 by rows); the
partial fc2 sums are added by the token dispatcher, so the expert linears do no TP communication.
"""
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.activations import glu, glu_extras
from megatron.core.fusions.compile import compile_available
from megatron.core.fusions.grad_accumulation import claim_first_write
from megatron.core.fusions.grouped_wgrad import grouped_wgrad_into_main_grad
from megatron.core.fusions.swiglu import swiglu, triton_swiglu_available
from megatron.core.fusions.weighted_squared_relu import uses_weighted_squared_relu, weighted_squared_relu
from megatron.core.process_groups_config import get_pg, get_pg_size
from megatron.core.tensor_parallel.layers import _make_param, set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.weight_grad import main_grad_placeholder
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.delayed_wgrad import DelayedWgrad, accumulate_param_grad
from megatron.core.transformer.moe.moe_utils import _with_eager_fallback, refuse_host_read_in_capture
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import divide, lazy_names

# Megatron's typing Protocols for Transformer Engine's grouped linears (types only), resolved on first use.
__getattr__ = lazy_names(__name__, {name: "megatron.core._compat.experts" for name in (
    "GroupedLinearFc1Interface", "GroupedLinearFc1Builder", "GroupedLinearFc2Interface", "GroupedLinearFc2Builder")})


def expert_io_size(config) -> int:
    """The routed experts' input and output width: --moe-latent-size where the layer projects its tokens into a
    latent space before the dispatch, else the hidden size."""
    return getattr(config, "moe_latent_size", None) or config.hidden_size


@dataclass
class GroupedMLPSubmodules:
    """TEGroupedMLP's spec: Transformer Engine's grouped linears in Megatron. Here the grouped GEMM of
    GroupedMLP replaces them whatever they name; ``activation_func`` (a TE activation module) is used
    only with use_te_activation_func, which this build refuses."""
    linear_fc1: Union[ModuleSpec, type] = None
    linear_fc2: Union[ModuleSpec, type] = None
    activation_func: Union[ModuleSpec, type] = None


def _glu_activation(h, config):
    if config.gated_linear_unit:  # [gate; up]: [n, f/etp] each
        return glu(h, config.activation_func, config.glu_linear_offset, config.activation_func_clamp_value)
    return config.activation_func(h)


def _swiglu_scaled(h, probs):
    gate, up = torch.chunk(h, 2, dim=-1)
    out = torch.nn.functional.silu(gate) * up
    return out if probs is None else out * probs.unsqueeze(-1).to(out.dtype)


_FUSED_SWIGLU = {}


def _fused_swiglu_scaled(h, probs):
    """silu(gate) * up * routing prob as one element-wise kernel per direction (CUDA, with
    --bias-swiglu-fusion, Megatron's default): eager it is five passes forward and six backward over the
    [tokens x top-k, 2f] expert activations. The Triton kernels of `fusions.swiglu` where Triton runs;
    else compiled for a dynamic token count (it changes every micro-batch), and if compilation fails,
    the eager form from then on, said once."""
    if triton_swiglu_available(h):
        return swiglu(h, probs)
    if "fn" not in _FUSED_SWIGLU:
        _FUSED_SWIGLU["fn"] = _with_eager_fallback(torch.compile(_swiglu_scaled, dynamic=True), _swiglu_scaled,
                                                   "--bias-swiglu-fusion for grouped experts",
                                                   "the eager activation")
    return _FUSED_SWIGLU["fn"](h, probs)


def _use_fused_swiglu(h, config) -> bool:
    return (h.is_cuda and config.gated_linear_unit and config.bias_activation_fusion and not glu_extras(config)
            and config.activation_func is torch.nn.functional.silu and not torch.compiler.is_compiling()
            and (triton_swiglu_available(h) or compile_available()))


def _etp_size(pg_collection=None) -> int:
    return get_pg_size(pg_collection, "expt_tp", "GroupedMLP")


def grouped_mm_available(x: torch.Tensor, *dims: int) -> bool:
    """torch._grouped_mm runs on sm90+ CUDA in bf16 with every GEMM dim a multiple of 8 (16-byte rows)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(d % 8 == 0 for d in dims)


class GroupedLinear(torch.autograd.Function):
    """Y_i = X_i W_i^T for the row blocks X_i of ``x`` (block ends ``offs``), W [E, out, in]: one grouped GEMM
    forward, and two backward: dX_i = dY_i W_i and dW_i = dY_i^T X_i (offs splitting the reduction dim).
    With a ``wgrad_store`` (--delay-wgrad-compute) backward returns dX only and parks the dW GEMM there.
    With ``fuse_wgrad`` (gradient_accumulation_fusion) and a DDP-managed weight, dW goes straight into the
    weight's fp32 ``main_grad`` (megatron/core/fusions/grouped_wgrad.py), as the dense linears' fused wgrad does."""

    @staticmethod
    def forward(ctx, x, weight, offs, wgrad_store=None, fuse_wgrad=False):
        ctx.save_for_backward(x, weight, offs)
        ctx.weight, ctx.wgrad_store, ctx.fuse_wgrad = weight, wgrad_store, fuse_wgrad
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)  # [N, out]

    @staticmethod
    def backward(ctx, grad):
        x, weight, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, weight, offs=offs)  # [N, in]
        param = ctx.weight
        fused = ctx.fuse_wgrad and _into_main_grad(param)
        def wgrad():  # fused: added into main_grad, and DDP's placeholder for autograd; else [E, out, in]
            if fused:
                return _wgrad_into_main_grad(param, grad, x, offs)
            return torch._grouped_mm(grad.t(), x, offs=offs).to(weight.dtype)

        if ctx.wgrad_store is not None:
            ctx.wgrad_store.defer(lambda: accumulate_param_grad(param, wgrad()))
            return grad_x, None, None, None, None
        return grad_x, wgrad(), None, None, None


def _into_main_grad(param: torch.Tensor) -> bool:
    """The weight is DDP's (its fp32 buffer and the flag its grad hook reads exist) and no trace is running."""
    return (getattr(param, "main_grad", None) is not None and hasattr(param, "grad_added_to_main_grad")
            and not getattr(param, "zero_out_wgrad", False) and not torch.compiler.is_compiling())


def _wgrad_into_main_grad(param, grad, x, offs) -> torch.Tensor:
    """dW_e = dY_e^T X_e added into ``param.main_grad`` (written, for the iteration's first gradient on DDP's
    zeroed buffer); returns DDP's placeholder for autograd."""
    grouped_wgrad_into_main_grad(param.main_grad, grad, x, offs, overwrite=claim_first_write(param))
    return main_grad_placeholder(param)


class LoopGroupedLinear(torch.autograd.Function):
    """GroupedLinear as a loop over the experts (any device and dtype), for --delay-wgrad-compute:
    backward returns dX_i = dY_i W_i and parks dW_i = dY_i^T X_i in ``wgrad_store``."""

    @staticmethod
    def forward(ctx, x, weight, counts, wgrad_store):
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.weight, ctx.wgrad_store = counts, weight, wgrad_store
        return torch.cat([c @ weight[i].t() for i, c in enumerate(torch.split(x, counts))], dim=0)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        counts, param = ctx.counts, ctx.weight
        grads = torch.split(grad, counts)
        grad_x = torch.cat([g @ weight[i] for i, g in enumerate(grads)], dim=0)

        def wgrad():
            xs = torch.split(x, counts)
            accumulate_param_grad(param, torch.stack([g.t() @ xi for g, xi in zip(grads, xs)]))
        ctx.wgrad_store.defer(wgrad)
        return grad_x, None, None, None


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor, offs=None,
                 wgrad_store: Optional[DelayedWgrad] = None, fuse_wgrad: bool = False):
    """Row block i of ``x`` [N, k] (``tokens_per_expert[i]`` rows) times ``weight[i]``^T ([out, k]) -> [N, out].

    ``offs``: int32 cumulative row ends on the device (computed once per layer and shared by fc1 and fc2);
    without it a loop over the experts (which reads the counts on the host). ``wgrad_store``: park the
    weight gradient there (--delay-wgrad-compute). ``fuse_wgrad``: add the weight gradient into the weight's
    ``main_grad`` in backward (gradient_accumulation_fusion; grouped GEMM path only)."""
    if offs is not None:
        return GroupedLinear.apply(x, weight, offs, wgrad_store, fuse_wgrad)
    refuse_host_read_in_capture(x, "the per-expert GEMM loop (torch._grouped_mm unavailable for these experts)")
    counts = tokens_per_expert.tolist()
    if wgrad_store is not None:
        return LoopGroupedLinear.apply(x, weight, counts, wgrad_store)
    chunks = torch.split(x, counts, dim=0)
    return torch.cat([chunk @ weight[i].t() for i, chunk in enumerate(chunks)], dim=0)


class GroupedMLP(MegatronModule):
    """weight1 [E_local, (2)f/etp, h] and weight2 [E_local, h, f/etp] (each expert's matrix is laid out as
    its fc1/fc2 linear weight); ``expert_dim`` 0 makes checkpoints and initialization see the global
    [E, ...] tensors, so any EP layout reads any other. ``pg_collection``: its ``expt_tp`` group splits
    the weights (parallel_state's when None); the experts themselves do no communication."""

    def __init__(self, num_local_experts: int, config, pg_collection=None):
        super().__init__(config)
        if config.add_bias_linear:
            raise ValueError("--moe-grouped-gemm experts have no biases; pass --disable-bias-linear")
        self.num_local_experts = num_local_experts
        etp = _etp_size(pg_collection)
        ffn = config.moe_ffn_hidden_size
        glu = config.gated_linear_unit
        fc1_out = divide(2 * ffn if glu else ffn, etp)
        width = expert_io_size(config)
        self.weight1 = _make_param((num_local_experts, fc1_out, width), config,
                                   config.init_method, is_expert=True)
        set_tensor_model_parallel_attributes(self.weight1, True, 1, 2 if glu else 1)
        self.weight2 = _make_param((num_local_experts, width, divide(ffn, etp)), config,
                                   config.output_layer_init_method, is_expert=True)
        set_tensor_model_parallel_attributes(self.weight2, True, 2, 1)
        for w, name in ((self.weight1, "linear_fc1.weight"), (self.weight2, "linear_fc2.weight")):
            w.expert_dim = 0
            w.per_expert_name = name  # initialized like SequentialMLP's expert linears
        # --delay-wgrad-compute: the weight gradients wait here until the dispatcher's backward
        # all-to-all is in flight (it flushes the store; see delayed_wgrad.py).
        self.wgrad_store = DelayedWgrad() if getattr(config, "delay_wgrad_compute", False) else None
        if self.wgrad_store is not None:
            self.weight1.delay_wgrad = self.weight2.delay_wgrad = True

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: Optional[torch.Tensor] = None):
        x = permuted_local_hidden_states  # [N, h]
        offs = None
        if grouped_mm_available(x, x.shape[-1], self.weight1.shape[1], self.weight2.shape[2]):
            offs = torch.cumsum(tokens_per_expert.to(x.device, non_blocking=True), 0).to(torch.int32)
        fuse = bool(getattr(self.config, "gradient_accumulation_fusion", False))
        h = grouped_gemm(x, self.weight1, tokens_per_expert, offs, self.wgrad_store, fuse)  # [N, (2)f/etp]
        if _use_fused_swiglu(h, self.config):
            h = _fused_swiglu_scaled(h, permuted_probs)
        elif permuted_probs is not None and uses_weighted_squared_relu(self.config):
            h = weighted_squared_relu(h, permuted_probs)
        else:
            h = _glu_activation(h, self.config)
            if permuted_probs is not None:
                h = h * permuted_probs.unsqueeze(-1).to(h.dtype)
        out = grouped_gemm(h, self.weight2, tokens_per_expert, offs, self.wgrad_store, fuse)
        return out, None  # [N, h], partial over etp


class TEGroupedMLP(GroupedMLP):
    """Megatron's name and constructor for grouped-GEMM experts (no Transformer Engine here: the
    ``submodules`` name TE's grouped linears, which the grouped GEMM replaces; same parameters and
    checkpoint layout as GroupedMLP)."""

    def __init__(self, num_local_experts: int, config, submodules: Optional[GroupedMLPSubmodules] = None,
                 pg_collection=None, name: Optional[str] = None):
        super().__init__(num_local_experts, config, pg_collection)
        self.name = name


class SequentialMLP(MegatronModule):
    """A loop over ``local_experts`` (each our MLP with ``is_expert=True``, split over the ``expt_tp`` group
    of ``pg_collection``, or parallel_state's expert-TP group when None)."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None,
                 name: Optional[str] = None):
        super().__init__(config)
        self.name = name
        self.num_local_experts = num_local_experts
        etp_group = None if pg_collection is None else get_pg(pg_collection, "expt_tp", "SequentialMLP")
        self.local_experts = torch.nn.ModuleList(
            MLP(config, submodules, is_expert=True, ffn_hidden_size=config.moe_ffn_hidden_size, tp_group=etp_group,
                input_size=expert_io_size(config), output_size=expert_io_size(config))
            for _ in range(num_local_experts))

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: Optional[torch.Tensor] = None):
        refuse_host_read_in_capture(permuted_local_hidden_states, "SequentialMLP (no --moe-grouped-gemm)")
        counts = tokens_per_expert.tolist()
        chunks = torch.split(permuted_local_hidden_states, counts, dim=0)
        scales = [None] * len(chunks) if permuted_probs is None else torch.split(permuted_probs, counts)
        outputs = []
        for expert, chunk, scale in zip(self.local_experts, chunks, scales):
            out, bias = expert(chunk, per_token_scale=scale)
            outputs.append(out if bias is None else out + bias)
        return torch.cat(outputs, dim=0), None
