"""The Triton kernel behind ``grad_accumulation.accumulate_into_main_grad`` (imported only on CUDA)."""
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _accumulate_kernel(main_ptr, grad_ptr, n, ADD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    grad = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    if ADD:
        grad += tl.load(main_ptr + offs, mask=mask)
    tl.store(main_ptr + offs, grad, mask=mask)


def accumulate(main_grad, grad, add=True):
    """main_grad += grad, or with ``add=False`` main_grad = grad (no read of main_grad)."""
    n = main_grad.numel()
    _accumulate_kernel[(triton.cdiv(n, BLOCK),)](main_grad, grad, n, ADD=add, BLOCK=BLOCK)
