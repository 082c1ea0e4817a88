"""Weight gradients of the TP linears: dL/dW = g^T x, optionally added straight into ``weight.main_grad``.

The plain, overlapped (``overlap.py``) and FP8 (``fp8/fp8_linear.py``) linears all end in these helpers,
so they live below all three. Also the deferred output-layer GEMMs of --defer-embedding-wgrad-compute,
run at the end of a step (pipeline_parallel/deferred_output_wgrad.py).
"""
import torch

from megatron.core.fusions.grad_accumulation import claim_first_write
from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

_ADDMM_OUT_DTYPE = True  # set False once if this torch has no addmm(out_dtype=, out=) on CUDA
_MM_OUT_DTYPE = True  # set False once if this torch has no mm(out_dtype=, out=) on CUDA


def _accumulate_weight_grad(main_grad, g2d, x2d, overwrite: bool = False):
    """main_grad += g^T x; with ``overwrite`` (main_grad holds zeros: the iteration's first gradient)
    main_grad = g^T x, a GEMM that does not read the fp32 buffer (beta = 0). With 16-bit operands on CUDA
    the GEMM runs on tensor cores with an fp32 output (as Megatron's fused wgrad kernel); upcasting the
    operands first would put it on the fp32 SIMT path, several times slower than everything else in the step."""
    global _ADDMM_OUT_DTYPE, _MM_OUT_DTYPE
    if g2d.is_cuda and g2d.dtype in (torch.bfloat16, torch.float16) and main_grad.dtype == torch.float32:
        if overwrite and _MM_OUT_DTYPE and not torch.compiler.is_compiling():
            try:
                torch.mm(g2d.t(), x2d, out_dtype=torch.float32, out=main_grad)
                return
            except torch.OutOfMemoryError:
                raise
            except (TypeError, RuntimeError, NotImplementedError):
                _MM_OUT_DTYPE = False  # then the add below: main_grad holds zeros
        if _ADDMM_OUT_DTYPE and not torch.compiler.is_compiling():  # dynamo has no meta for it
            try:
                # The GEMM epilogue adds into main_grad (beta = 1): no fp32 temporary to write and re-read.
                torch.addmm(main_grad, g2d.t(), x2d, out_dtype=torch.float32, out=main_grad)
                return
            except torch.OutOfMemoryError:
                raise
            except (TypeError, RuntimeError, NotImplementedError):
                _ADDMM_OUT_DTYPE = False  # older torch: fp32-output GEMM, then a separate add
        try:
            main_grad.add_(torch.mm(g2d.t(), x2d, out_dtype=torch.float32))
            return
        except TypeError:  # torch without mm(out_dtype=): 16-bit GEMM, then accumulate in fp32
            main_grad.add_(g2d.t() @ x2d)
            return
    grad = g2d.t().to(main_grad.dtype) @ x2d.to(main_grad.dtype)
    main_grad.copy_(grad) if overwrite else main_grad.add_(grad)


def main_grad_placeholder(weight):
    """The gradient autograd sees for a DDP weight whose gradient already went into ``main_grad``:
    DDP's per-param hook must still fire, and it skips this tensor, so it needs no memset, unless
    the param also gets a real .grad elsewhere (tied embedding, `zero_out_wgrad`) that autograd adds
    it to."""
    weight.grad_added_to_main_grad = True
    make = torch.zeros_like if getattr(weight, "zero_out_wgrad", False) else torch.empty_like
    return make(weight)


def weight_grad(weight, fusion, g2d, x2d):
    """dL/dW = g^T x, or with ``fusion`` added into ``weight.main_grad`` (returning DDP's placeholder).

    Traced into a compiled layer (--torch-compile), the plain gradient is returned and DDP's hook adds it
    to main_grad: the fused form is a side effect of the backward (an in-place add into a tensor that is
    no input of the function, and the ``grad_added_to_main_grad`` flag that tells the hook to skip the
    placeholder), which torch 2.11's traced autograd.Function dropped on CUDA: every TP linear of the
    compiled layers trained with a zero gradient. The overlapped linears run outside the graphs and keep
    the fused form."""
    if fusion and hasattr(weight, "main_grad") and not torch.compiler.is_compiling():
        # The iteration's first gradient on DDP's zeroed buffer is written, not added.
        _accumulate_weight_grad(weight.main_grad, g2d, x2d, overwrite=claim_first_write(weight))
        return main_grad_placeholder(weight) if hasattr(weight, "grad_added_to_main_grad") else None
    return g2d.t() @ x2d


def prepare_input_tensors_for_wgrad_compute(grad_output, all_gathered_input):
    """Contiguous 2-D views ([s*b, out], [s*b, in]) of a [s, b, *] output gradient and input."""
    grad_output, all_gathered_input = grad_output.contiguous(), all_gathered_input.contiguous()
    if grad_output.dim() == 3:
        grad_output = grad_output.view(-1, grad_output.shape[-1])
        all_gathered_input = all_gathered_input.view(-1, all_gathered_input.shape[-1])
    return grad_output, all_gathered_input


def drain_embedding_wgrad_compute(config, embedding_activation_buffer, grad_output_buffer, weight, tp_group):
    """weight.main_grad += sum_i g_i^T x_i over the parked output-layer calls, emptying both buffers (the
    end of a step under --defer-embedding-wgrad-compute). Under config.sequence_parallel each x_i is this
    rank's sequence chunk and is all-gathered over `tp_group` first."""
    if len(embedding_activation_buffer) != len(grad_output_buffer):
        raise ValueError("drain_embedding_wgrad_compute: activation and gradient buffers differ in length")
    if not hasattr(weight, "main_grad"):
        raise ValueError("drain_embedding_wgrad_compute: the weight has no main_grad (wrap the model in "
                         "DistributedDataParallel with gradient_accumulation_fusion)")
    first = claim_first_write(weight)  # main_grad holds zeros: the first GEMM writes, the rest add
    with torch.no_grad():
        _drain(config, embedding_activation_buffer, grad_output_buffer, weight, tp_group, first)


def _drain(config, embedding_activation_buffer, grad_output_buffer, weight, tp_group, first):
    while embedding_activation_buffer:
        x, grad = embedding_activation_buffer.pop(0), grad_output_buffer.pop(0)
        if grad is None:
            embedding_activation_buffer.clear()
            grad_output_buffer.clear()
            raise RuntimeError("drain_embedding_wgrad_compute: a parked output-layer input has no output gradient "
                               "(its backward did not run in this step)")
        if config.sequence_parallel:
            x = _gather_along_first_dim(x, tp_group)
        g2d, x2d = prepare_input_tensors_for_wgrad_compute(grad, x)
        _accumulate_weight_grad(weight.main_grad, g2d, x2d, overwrite=first)
        first = False
