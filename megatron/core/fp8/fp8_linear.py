"""Y = X W^T + b with all three GEMMs (forward, dgrad, wgrad) in FP8 via ``torch._scaled_mm``.

Recipe "tensorwise" (per-tensor current scaling): every operand is scaled by ``fp8_max / amax`` of its
own current values (optionally divided by ``2**margin``), cast to FP8, and the GEMM dequantizes with the
inverse scales. Formats as Megatron / Transformer Engine: ``e4m3`` uses E4M3 everywhere, ``hybrid``
uses E4M3 for activations and weights (forward) and E5M2 for gradients (backward, more range).

``_scaled_mm`` wants the first operand row-major and the second column-major, and every inner/outer
dim a multiple of 16; callers check ``fp8_supported_shape`` and keep a 16-bit GEMM otherwise.
"""
import torch

from megatron.core.fusions.compile import maybe_compile
from megatron.core.tensor_parallel.mappings import _gather_along_first_dim, _reduce_scatter_along_first_dim
from megatron.core.tensor_parallel.weight_grad import main_grad_placeholder

FP8_RECIPES = ("tensorwise",)
_FORMATS = ("e4m3", "hybrid")


def fp8_dtypes(fmt: str):
    """(forward dtype, gradient dtype) of an FP8 format."""
    if fmt not in _FORMATS:
        raise ValueError(f"--fp8-format '{fmt}' unknown; use e4m3 or hybrid")
    grad = torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn
    return torch.float8_e4m3fn, grad


def fp8_supported_shape(in_features: int, out_features: int) -> bool:
    return in_features % 16 == 0 and out_features % 16 == 0


def quantize_tensorwise(t: torch.Tensor, dtype, margin: int = 0):
    """(t cast to ``dtype`` after scaling its amax to the format's max / 2**margin, dequant scale fp32)."""
    fp8_max = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float().clamp(min=1e-12)
    scale = (fp8_max / (2.0 ** margin)) / amax  # fp32 scalar tensor, stays on t's device (no host sync)
    q = (t.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    return q, scale.reciprocal()


@maybe_compile
def quantize_tensorwise_with_transpose(t: torch.Tensor, dtype, margin: int = 0):
    """(q, q^T contiguous, dequant scale) of a 2-D ``t``: _scaled_mm needs each FP8 operand in both
    layouts across forward and backward. Compiled on CUDA into one amax reduction and one fused
    scale-cast(-transpose) pass; unfused, the abs / fp32 copy / scale / clamp / cast / transpose
    passes cost more than the FP8 GEMMs save."""
    q, inv_scale = quantize_tensorwise(t, dtype, margin)
    return q, q.t().contiguous(), inv_scale


def _mm(a8, sa, b8_col, sb, out_dtype, bias=None):
    return torch._scaled_mm(a8, b8_col, scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)


def _accumulate_main_grad(weight, grad_weight):
    """Gradient-accumulation fusion: add into ``weight.main_grad``; return what autograd should see."""
    weight.main_grad.add_(grad_weight)
    if hasattr(weight, "grad_added_to_main_grad"):
        return main_grad_placeholder(weight)
    return None


class Fp8LinearFunction(torch.autograd.Function):
    """FP8 counterpart of LinearWithGradAccumulationAndAsyncCommunication (same arguments, same SP and
    main_grad handling); saves the FP8 input and weight (half the bytes of 16-bit copies)."""

    @staticmethod
    def forward(ctx, x, weight, bias, gradient_accumulation_fusion, sequence_parallel, tp_group, fmt, margin):
        fwd_dtype, grad_dtype = fp8_dtypes(fmt)
        total = _gather_along_first_dim(x, tp_group) if sequence_parallel else x  # [s, b, in]
        x2d = total.reshape(-1, total.shape[-1])  # [s*b, in]
        x8, x8_t, sx = quantize_tensorwise_with_transpose(x2d, fwd_dtype, margin)  # [s*b, in], [in, s*b]
        w8, w8_t, sw = quantize_tensorwise_with_transpose(weight, fwd_dtype, margin)  # [out, in], [in, out]
        bias16 = bias.to(x.dtype) if bias is not None else None
        out = _mm(x8, sx, w8.t(), sw, x.dtype, bias16)  # [s*b, out]; w8.t() is column-major already
        # Backward reads X and W only in the transposed layouts (as column-major second operands).
        ctx.save_for_backward(x8_t, sx, w8_t, sw)
        ctx.weight = weight
        ctx.use_bias, ctx.fusion = bias is not None, gradient_accumulation_fusion
        ctx.sequence_parallel, ctx.tp_group = sequence_parallel, tp_group
        ctx.grad_dtype, ctx.margin, ctx.in_dtype = grad_dtype, margin, x.dtype
        return out.view(*total.shape[:-1], out.shape[-1])  # [s, b, out]

    @staticmethod
    def backward(ctx, grad_output):
        x8_t, sx, w8_t, sw = ctx.saved_tensors
        weight = ctx.weight
        g2d = grad_output.reshape(-1, grad_output.shape[-1])  # [s*b, out]
        g8, g8_t, sg = quantize_tensorwise_with_transpose(g2d, ctx.grad_dtype, ctx.margin)
        # dgrad: [s*b, out] @ [out, in] (column-major: the transpose of row-major w8_t)
        grad_input = _mm(g8, sg, w8_t.t(), sw, ctx.in_dtype)
        grad_input = grad_input.view(*grad_output.shape[:-1], grad_input.shape[-1])  # [s, b, in]
        if ctx.sequence_parallel:
            grad_input = _reduce_scatter_along_first_dim(grad_input, ctx.tp_group)  # [s/tp, b, in]
        # wgrad: [out, s*b] @ [s*b, in], fp32 output when it goes into main_grad
        use_main = ctx.fusion and hasattr(weight, "main_grad")
        wdtype = weight.main_grad.dtype if use_main else weight.dtype
        grad_weight = _mm(g8_t, sg, x8_t.t(), sx, wdtype)  # [out, s*b] @ [s*b, in]
        if use_main:
            grad_weight = _accumulate_main_grad(weight, grad_weight)
        grad_bias = g2d.sum(dim=0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def fp8_linear(x, weight, bias, gradient_accumulation_fusion=False, sequence_parallel=False, tp_group=None,
               fmt="hybrid", margin=0):
    """FP8 linear when the token count suits _scaled_mm (multiple of 16, needed by the wgrad GEMM);
    returns None otherwise so the caller runs its 16-bit GEMM for this call."""
    tokens = x.numel() // x.shape[-1]
    if sequence_parallel and tp_group is not None:
        tokens *= torch.distributed.get_world_size(tp_group)
    if tokens % 16 != 0:
        return None
    return _apply_outside_compiled_graph(x, weight, bias, gradient_accumulation_fusion, sequence_parallel,
                                         tp_group, fmt, margin)


@torch.compiler.disable
def _apply_outside_compiled_graph(*args):
    """Under --torch-compile the FP8 function runs between the layer's compiled pieces: traced into the
    layer, its backward's quantization ran unfused (measured: ~100 ms of element-wise kernels per
    gpt-1.3b step); run as its own function, forward and backward both use the compiled quantizer."""
    return Fp8LinearFunction.apply(*args)
