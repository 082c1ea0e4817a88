"""Tensor-parallel linear and embedding layers; all TP communication of the model lives here."""
import contextlib
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.fusions.grad_accumulation import claim_first_write
from megatron.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    _reduce_scatter_along_first_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.tensor_parallel.weight_grad import (  # noqa: F401  (_accumulate_weight_grad: its old home)
    _accumulate_weight_grad,
    main_grad_placeholder,
    weight_grad,
)
from megatron.core.utils import divide, get_device

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def param_is_not_tensor_parallel_duplicate(param, tp_group=None, expert_tp_group=None) -> bool:
    """True for TP-split params and, for replicated ones, on TP rank 0 only (count each once).
    Expert params (`allreduce` False) use `expert_tp_group` when given."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    group = expert_tp_group if not getattr(param, "allreduce", True) and expert_tp_group is not None else tp_group
    return (group.rank() if group is not None else parallel_state.get_tensor_model_parallel_rank()) == 0


def param_is_not_gtp_duplicate(param) -> bool:
    """True when the param's gradient is counted once across Megatron's generalized-TP (weight
    rematerialisation) axis. That axis is always of size 1 here (gtp_remat is not implemented), so
    every param is counted."""
    return True


def copy_gtp_attributes(destination, source) -> None:
    """Carry Megatron's generalized-TP tags (`is_gtp_weight_remat`, `allreduce`) over to a copy of a param
    (e.g. an fp32 main param), so code that classifies params sees the same tags on both."""
    for attr in ("is_gtp_weight_remat", "allreduce"):
        if hasattr(source, attr):
            setattr(destination, attr, getattr(source, attr))


def set_tensor_model_parallel_attributes(tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Record how ``tensor`` is split over TP: ``dim`` and ``stride`` (stride > 1: the global tensor is
    ``stride`` interleaved blocks along ``dim``, each split across TP, e.g. SwiGLU's [gate; up])."""
    for attr in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        assert not hasattr(tensor, attr), f"{attr} already set"
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor) -> None:
    for attr, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attr):
            setattr(tensor, attr, value)


def copy_tensor_model_parallel_attributes(destination_tensor, source_tensor) -> None:
    for attr in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attr):
            setattr(destination_tensor, attr, getattr(source_tensor, attr))


def param_home_device(config) -> torch.device:
    """Where a model's weights live: the CPU with --use-cpu-initialization, else this rank's GPU (or the CPU)."""
    return torch.device("cpu") if config.use_cpu_initialization else get_device()


def _param_device(config):
    """Where a layer allocates its weights: the meta device with --init-model-with-meta-device (no memory, no
    first draw; the model materializes them on `param_home_device` and fills them once, layout-independently),
    else their home. Without initialization (--no-initialization: the weights come from a checkpoint) nothing
    would materialize them, so they are allocated at home."""
    if getattr(config, "init_model_with_meta_device", False) and config.perform_initialization:
        return torch.device("meta")
    return param_home_device(config)


def _make_param(shape, config, init_fn, is_expert=False) -> torch.nn.Parameter:
    """Allocate a parameter, fill it with ``init_fn`` under the TP RNG state, and remember ``init_fn``
    so layout-independent initialization can redo it on the global tensor."""
    p = torch.nn.Parameter(torch.empty(*shape, dtype=config.params_dtype, device=_param_device(config)))
    if config.perform_initialization and not p.is_meta:
        # Models overwrite this with layout-independent values (transformer/initialize.py); a standalone
        # layer uses the TP RNG stream when seeded, else the default generator.
        name = get_expert_parallel_rng_tracker_name() if is_expert else "model-parallel-rng"
        tracker = get_cuda_rng_tracker()
        with tracker.fork(name) if name in tracker.get_states() else contextlib.nullcontext():
            init_fn(p.data)
    p.init_fn = init_fn
    p.allreduce = not is_expert
    return p


def _gathered_linear(x, weight, bias, sequence_parallel, tp_group):
    """X W^T + b, X all-gathered along the sequence first under SP ([s/tp, b, h] -> [s, b, h])."""
    total = _gather_along_first_dim(x, tp_group) if sequence_parallel else x  # [s, b, h]
    if bias is not None and total.is_cuda:  # the bias added in the GEMM's epilogue, not a second pass
        out = torch.addmm(bias, total.reshape(-1, total.shape[-1]), weight.t())
        return out.view(*total.shape[:-1], weight.shape[0])
    out = torch.matmul(total, weight.t())
    return out + bias if bias is not None else out


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """Y = X W^T + b. With ``gradient_accumulation_fusion`` the weight gradient is added straight into
    ``weight.main_grad`` (the DDP buffer) instead of ``weight.grad``."""

    @staticmethod
    def forward(ctx, x, weight, bias, gradient_accumulation_fusion, sequence_parallel=False, tp_group=None):
        # Under SP, X arrives split along the sequence: all-gather it here and save only the local
        # chunk (re-gathered in backward), so the full [s, b, h] input is never kept for backward.
        ctx.save_for_backward(x, weight)
        ctx.use_bias = bias is not None
        ctx.fusion = gradient_accumulation_fusion
        ctx.sequence_parallel, ctx.tp_group = sequence_parallel, tp_group
        return _gathered_linear(x, weight, bias, sequence_parallel, tp_group)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        if ctx.sequence_parallel:
            x = _gather_along_first_dim(x, ctx.tp_group)  # [s, b, h]
        grad_input = grad_output.matmul(weight)
        if ctx.sequence_parallel:
            grad_input = _reduce_scatter_along_first_dim(grad_input, ctx.tp_group)  # [s/tp, b, h]
        g2d = grad_output.reshape(-1, grad_output.shape[-1])  # [s*b, out]
        x2d = x.reshape(-1, x.shape[-1])  # [s*b, in]
        grad_bias = g2d.sum(dim=0) if ctx.use_bias else None
        return grad_input, weight_grad(weight, ctx.fusion, g2d, x2d), grad_bias, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(input, weight, bias, gradient_accumulation_fusion=False,
                                                      allreduce_dgrad=False, sequence_parallel=False,
                                                      grad_output_buffer=None, wgrad_deferral_limit=0,
                                                      tp_group=None, gtp_remat_size=1):
    """Y = X W^T + b; `allreduce_dgrad` all-reduces dL/dX over TP (what a column-parallel layer
    without SP needs). Deferred embedding wgrad (`grad_output_buffer`) and weight rematerialisation
    (`gtp_remat_size` > 1) are refused."""
    if grad_output_buffer is not None or gtp_remat_size != 1:
        raise NotImplementedError("deferred embedding wgrad (grad_output_buffer) and gtp_remat_size > 1 are "
                                  "not supported; leave them at None / 1")
    if allreduce_dgrad and not sequence_parallel:
        input = copy_to_tensor_model_parallel_region(input, tp_group)  # backward: all-reduce dL/dX
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, gradient_accumulation_fusion, sequence_parallel, tp_group)


class LinearWithFrozenWeight(torch.autograd.Function):
    """Y = X W^T + b for a weight that is not trained: saves only W, returns no weight gradient.
    `allreduce_dgrad` all-reduces dL/dX over `tp_group` in backward."""

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        out = torch.matmul(input, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad and ctx.tp_group is not None and ctx.tp_group.size() > 1:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None


def linear_with_frozen_weight(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                              sequence_parallel, tp_group, grad_output_buffer=None, wgrad_deferral_limit=None,
                              gtp_remat_size=1):
    """Linear layer for a frozen weight (same forward and dL/dX as the trainable path, no dL/dW).
    `gradient_accumulation_fusion` has no effect (there is no weight gradient); under
    `sequence_parallel` the input is all-gathered along the sequence and dL/dX reduce-scattered."""
    if grad_output_buffer is not None or wgrad_deferral_limit is not None or gtp_remat_size != 1:
        raise NotImplementedError("linear_with_frozen_weight: grad_output_buffer / wgrad_deferral_limit / "
                                  "gtp_remat_size belong to the trainable path; leave them at None / None / 1")
    tp_group = parallel_state.get_tensor_model_parallel_group() if tp_group is None else tp_group
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    return LinearWithFrozenWeight.apply(input, weight, bias, allreduce_dgrad, tp_group)


_FP8_FALLBACKS_REPORTED = set()


def _fp8_fallback_once(what: str) -> None:
    if what not in _FP8_FALLBACKS_REPORTED:
        _FP8_FALLBACKS_REPORTED.add(what)
        warnings.warn(f"--fp8-format: {what}; this GEMM runs in 16 bits", stacklevel=3)


def _fp8_format_for(config, in_features, out_features, tp_comm_buffer_name):
    """The FP8 format this layer uses, or None. As with Transformer Engine, only the transformer
    layers' linears (qkv, proj, fc1, fc2: those given a tp_comm_buffer_name) run in FP8; the output
    layer stays 16-bit. _scaled_mm needs both weight dims to be multiples of 16."""
    fmt = getattr(config, "fp8", None)
    if not fmt or tp_comm_buffer_name is None:
        return None
    from megatron.core.fp8 import fp8_supported_shape  # lazy: loads fp8_linear, torch._dynamo import ~1 s
    if not fp8_supported_shape(in_features, out_features):
        _fp8_fallback_once(f"layer '{tp_comm_buffer_name}' weight [{out_features}, {in_features}] has a dim "
                           "that is not a multiple of 16")
        return None
    return fmt


def _linear_maybe_fp8(fmt, config, x, weight, bias, sequence_parallel=False, tp_group=None):
    """The layer's GEMM: FP8 when ``fmt`` is set and the token count allows it, else 16-bit."""
    fusion = config.gradient_accumulation_fusion
    if fmt is not None:
        from megatron.core.fp8 import fp8_linear  # lazy: torch._dynamo import, ~1 s, only under --fp8-format
        out = fp8_linear(x, weight, bias, fusion, sequence_parallel, tp_group, fmt, config.fp8_margin)
        if out is not None:
            return out
        _fp8_fallback_once("token count (sequence x micro-batch) is not a multiple of 16")
    return linear_with_grad_accumulation_and_async_allreduce(x, weight, bias, fusion,
                                                             sequence_parallel=sequence_parallel, tp_group=tp_group)


def _overlaps(config, sequence_parallel, tp, fp8_format) -> bool:
    """--tp-comm-overlap applies to this layer: SP over more than one rank, 16-bit GEMMs (the FP8
    linears keep their own, non-overlapped communication)."""
    return bool(getattr(config, "tp_comm_overlap", False)) and sequence_parallel and tp > 1 and fp8_format is None


def _check_unsupported(embedding_activation_buffer, grad_output_buffer, keep_master_weight_for_test):
    if (embedding_activation_buffer is None) != (grad_output_buffer is None):
        raise ValueError("ColumnParallelLinear: pass both embedding_activation_buffer and grad_output_buffer "
                         "(--defer-embedding-wgrad-compute), or neither")
    if keep_master_weight_for_test:
        raise NotImplementedError("keep_master_weight_for_test is not supported")


class _LinearWithDeferredWgrad(torch.autograd.Function):
    """Y = X W^T + b for the last stage's output layer under --defer-embedding-wgrad-compute.

    The pipeline's last stage runs each micro-batch's backward, sends its input gradient upstream and, on
    the flush, idles while the earlier stages finish theirs. The output layer's weight-gradient GEMM (a
    vocabulary-wide one, ~1/3 of that layer's work) does not feed that input gradient: parking it
    (`slot`, an index into the model's activation and gradient buffers) shortens every last-stage
    backward on the pipeline's critical path, and the parked GEMMs run at the end of the step
    (`pipeline_parallel.deferred_output_wgrad`). A call past --wgrad-deferral-limit (`slot` None)
    adds its gradient into ``main_grad`` at once. Either way autograd gets no weight gradient and DDP's hook
    skips the weight (``delay_wgrad``), so its bucket is not reported ready before the parked GEMMs are in:
    the step's end reports it."""

    @staticmethod
    def forward(ctx, x, weight, bias, sequence_parallel, tp_group, grads, slot):
        ctx.save_for_backward(x, weight)
        ctx.use_bias = bias is not None
        ctx.sequence_parallel, ctx.tp_group = sequence_parallel, tp_group
        ctx.grads, ctx.slot = grads, slot
        return _gathered_linear(x, weight, bias, sequence_parallel, tp_group)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.sequence_parallel:
            grad_input = _reduce_scatter_along_first_dim(grad_input, ctx.tp_group)  # [s/tp, b, h]
        g2d = grad_output.reshape(-1, grad_output.shape[-1])
        if ctx.slot is not None:
            ctx.grads[ctx.slot] = grad_output.detach()  # its GEMM runs with the parked activation at the step's end
        else:
            if not hasattr(weight, "main_grad"):
                raise RuntimeError("--defer-embedding-wgrad-compute adds the output layer's weight gradient into "
                                   "main_grad: wrap the model in DistributedDataParallel")
            total = _gather_along_first_dim(x, ctx.tp_group) if ctx.sequence_parallel else x
            _accumulate_weight_grad(weight.main_grad, g2d, total.reshape(-1, total.shape[-1]),
                                    overwrite=claim_first_write(weight))
        grad_bias = g2d.sum(dim=0) if ctx.use_bias else None
        return grad_input, None, grad_bias, None, None, None, None


def _park_output_layer_input(activations, grads, limit: int, x):
    """The slot of this call in the deferral buffers (its input parked), or None past `limit` (0: no limit).
    Slots pair each activation with its own gradient whatever order the backward runs the calls in (the
    main head and the MTP depths call the output layer once each)."""
    if limit and len(activations) >= limit:
        return None
    activations.append(x)
    grads.append(None)
    return len(activations) - 1


class ColumnParallelLinear(torch.nn.Module):
    """Y = XA + b with A split by columns, A = [A_1, ..., A_p]: rank i computes Y_i = X A_i + b_i.

    Input is full (or sequence-split under SP, then all-gathered); output is split on the last dim
    unless ``gather_output``. Returns ``(output, bias)``; bias is returned unapplied with ``skip_bias_add``.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Callable, bias: bool = True,
                 gather_output: bool = False, stride: int = 1, keep_master_weight_for_test: bool = False,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False,
                 embedding_activation_buffer=None, grad_output_buffer=None, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, disable_grad_reduce: bool = False, tp_group=None,
                 name: Optional[str] = None):
        super().__init__()
        _check_unsupported(embedding_activation_buffer, grad_output_buffer, keep_master_weight_for_test)
        self.config, self.is_expert = config, is_expert
        # --defer-embedding-wgrad-compute (the last stage's output layer): Megatron's two buffer lists
        self.embedding_activation_buffer, self.grad_output_buffer = embedding_activation_buffer, grad_output_buffer
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.disable_grad_reduce = disable_grad_reduce
        self.sequence_parallel = config.sequence_parallel and not is_expert
        self.tp_group = tp_group if tp_group is not None else (
            parallel_state.get_expert_tensor_parallel_group() if is_expert
            else parallel_state.get_tensor_model_parallel_group())
        tp = 1 if self.tp_group is None else torch.distributed.get_world_size(self.tp_group)
        self.output_size_per_partition = divide(output_size, tp)
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = _make_param((self.output_size_per_partition, input_size), config, init_method, is_expert)
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        self.fp8_format = _fp8_format_for(config, input_size, self.output_size_per_partition, tp_comm_buffer_name)
        self.tp_comm_overlap = _overlaps(config, self.sequence_parallel, tp, self.fp8_format) and (
            config.tp_comm_overlap_ag or config.tp_comm_bulk_dgrad or config.tp_comm_bulk_wgrad)
        if bias:
            self.bias = _make_param((self.output_size_per_partition,), config, torch.nn.init.zeros_, is_expert)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        if weight is None:
            if self.weight is None:
                raise RuntimeError("ColumnParallelLinear built with skip_weight_param_allocation needs a weight")
            weight = self.weight
        if self.sequence_parallel or self.disable_grad_reduce or self.is_expert:
            # SP: [s/tp, b, h], gathered inside the linear function. Experts: the MoE token dispatcher
            # gathers the tokens over expert-TP and sums their gradients itself.
            x = input_
        else:
            x = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        if self.grad_output_buffer is not None and torch.is_grad_enabled() and weight.requires_grad:
            # The deferred weight gradient (see _LinearWithDeferredWgrad); under --tp-comm-overlap this layer's
            # sequence-parallel gather then runs unchunked.
            # Autograd still runs the weight's post-accumulate hooks (with no gradient): DDP's skips a weight
            # marked delay_wgrad, whose gradient the step's end reports.
            weight.delay_wgrad = True
            slot = _park_output_layer_input(self.embedding_activation_buffer, self.grad_output_buffer,
                                            self.config.wgrad_deferral_limit, x.detach())
            out = _LinearWithDeferredWgrad.apply(x, weight, bias, self.sequence_parallel, self.tp_group,
                                                 self.grad_output_buffer, slot)
        elif self.tp_comm_overlap:
            # Its @torch.compiler.disable pulls in torch._dynamo: ~1.2 s of every process start (measured).
            from megatron.core.tensor_parallel.overlap import (  # lazy: torch._dynamo import, ~1.2 s
                column_parallel_linear_with_overlap,
            )
            c = self.config
            out = column_parallel_linear_with_overlap(x, weight, bias, c.gradient_accumulation_fusion, self.tp_group,
                                                      c.tp_comm_overlap_ag, c.tp_comm_bulk_dgrad,
                                                      c.tp_comm_bulk_wgrad)
        else:
            out = _linear_maybe_fp8(self.fp8_format, self.config, x, weight, bias,
                                    self.sequence_parallel, self.tp_group)  # [s, b, out/tp]
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(torch.nn.Module):
    """Y = XA + b with A split by rows and X by columns: Y = sum_i X_i A_i, then + b.

    The sum is an all-reduce over TP (a reduce-scatter along the sequence under SP); the bias is added
    once, after the reduction. Returns ``(output, bias)``.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Callable, bias: bool = True,
                 input_is_parallel: bool = False, skip_bias_add: bool = False, stride: int = 1,
                 keep_master_weight_for_test: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, tp_group=None, name: Optional[str] = None):
        super().__init__()
        _check_unsupported(None, None, keep_master_weight_for_test)
        self.config, self.is_expert = config, is_expert
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = config.sequence_parallel and not is_expert
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with --sequence-parallel needs input_is_parallel=True")
        self.tp_group = tp_group if tp_group is not None else (
            parallel_state.get_expert_tensor_parallel_group() if is_expert
            else parallel_state.get_tensor_model_parallel_group())
        tp = 1 if self.tp_group is None else torch.distributed.get_world_size(self.tp_group)
        self.input_size_per_partition = divide(input_size, tp)
        self.weight = _make_param((output_size, self.input_size_per_partition), config, init_method, is_expert)
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        self.fp8_format = _fp8_format_for(config, self.input_size_per_partition, output_size, tp_comm_buffer_name)
        self.tp_comm_overlap = _overlaps(config, self.sequence_parallel, tp, self.fp8_format) and (
            config.tp_comm_overlap_rs or config.tp_comm_overlap_ag)
        if bias:
            self.bias = _make_param((output_size,), config, torch.nn.init.zeros_, is_expert)
            set_defaults_if_not_set_tensor_model_parallel_attributes(self.bias)
            # Under SP each rank's bias grad covers only its sequence chunk: sum over TP.
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        x = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        if self.tp_comm_overlap:
            from megatron.core.tensor_parallel.overlap import (  # lazy: torch._dynamo import, ~1.2 s
                row_parallel_linear_with_overlap,
            )
            c = self.config
            out = row_parallel_linear_with_overlap(x, self.weight, c.gradient_accumulation_fusion, self.tp_group,
                                                   c.tp_comm_overlap_rs, c.tp_comm_overlap_ag)  # [s/tp, b, h]
            return _row_bias(out, self.bias, self.skip_bias_add)
        partial = _linear_maybe_fp8(self.fp8_format, self.config, x, self.weight, None)  # [s, b, h], partial sum
        if self.is_expert:
            out = partial  # the MoE token dispatcher sums expert-TP partials when it combines
        elif self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)  # [s/tp, b, h]
        else:
            out = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
        return _row_bias(out, self.bias, self.skip_bias_add)


def _row_bias(out, bias, skip_bias_add):
    if skip_bias_add:
        return out, bias
    return (out + bias if bias is not None else out), None


class _EmbeddingWithGradAccumulation(torch.autograd.Function):
    """Embedding lookup whose weight gradient goes straight into ``weight.main_grad`` (the DDP buffer) as
    a sorted, deterministic row accumulation of the [tokens, h] output gradient (``index_put_`` with
    ``accumulate``), instead of a dense [vocab, h] 16-bit gradient that DDP then adds to the fp32 buffer:
    with a 128k vocabulary that is ~6 GB of memory traffic per micro-batch saved. Without ``main_grad``
    (no DDP wrapper), for a tied embedding (its gradient also comes through ``.grad``), or under
    deterministic algorithms, the ordinary dense gradient."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        g2d = grad_output.reshape(-1, grad_output.shape[-1])
        main_grad = getattr(weight, "main_grad", None)
        if (main_grad is None or getattr(weight, "zero_out_wgrad", False)
                or torch.are_deterministic_algorithms_enabled()):
            return None, torch.ops.aten.embedding_dense_backward(grad_output, ids, weight.size(0), -1, False)
        main_grad.index_put_((ids.reshape(-1),), g2d.to(main_grad.dtype), accumulate=True)
        grad_weight = main_grad_placeholder(weight) if hasattr(weight, "grad_added_to_main_grad") else None
        return None, grad_weight


def _spread_rows(input_: torch.Tensor, rows: int) -> torch.Tensor:
    """A row for each token this rank does not own: the token's position modulo the shard's rows. Their
    looked-up rows are zeroed and their gradients are zero, so any row serves; spread ones keep the backward's
    row accumulation parallel. Sending them all to row 0 made one segment of every foreign token, which the
    sorted accumulation adds one after another (measured at TP=2, Llama-3's 128k vocabulary, seq 8192: 6 ms
    per micro-batch on the rank owning few of the tokens, which its peer then waited for)."""
    return (torch.arange(input_.numel(), device=input_.device) % rows).view(input_.shape)


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding with the vocabulary split across TP: each rank looks up the ids it owns, zeroes the
    rest, and the partial rows are summed over TP (reduce-scattered along the sequence with
    ``reduce_scatter_embeddings``, which also returns ``[s/tp, b, h]`` instead of ``[b, s, h]``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable, config,
                 reduce_scatter_embeddings: bool = False, tp_group=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
        tp = 1 if self.tp_group is None else torch.distributed.get_world_size(self.tp_group)
        rank = 0 if self.tp_group is None else torch.distributed.get_rank(self.tp_group)
        if num_embeddings % tp != 0:
            raise ValueError(f"vocab size {num_embeddings} is not divisible by the TP size {tp}; pad it with "
                             "--make-vocab-size-divisible-by")
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, rank, tp)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = _make_param((self.num_embeddings_per_partition, embedding_dim), config, init_method)
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self._tp = tp
        self._fuse_wgrad = bool(getattr(config, "gradient_accumulation_fusion", False))

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self._tp > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            ids = torch.where(outside, _spread_rows(input_, self.num_embeddings_per_partition),
                              input_ - self.vocab_start_index)
        else:
            ids = input_
        if self._fuse_wgrad and torch.is_grad_enabled() and self.weight.requires_grad:
            out = _EmbeddingWithGradAccumulation.apply(ids, self.weight)
        else:
            out = F.embedding(ids, self.weight)  # [b, s, h]
        if self._tp > 1:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            out = out.transpose(0, 1).contiguous()  # [s, b, h]
            return reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)  # [s/tp, b, h]
        return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
