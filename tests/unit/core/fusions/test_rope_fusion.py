"""--apply-rope-fusion's Triton kernel (megatron/core/fusions/rope.py): under Triton's CPU interpreter it equals the
eager rotation forward and backward (rope_interpreted_worker.py); it compiles for Hopper without a GPU; on CPU
tensors the fused path is not taken (rope_utils falls back)."""
import pytest
import torch

from megatron.core.fusions import rope as fused_rope
from tests.unit.core.fusions.interpreted import check_worker, needs_triton3


@needs_triton3
def test_rope_kernel_equals_eager_under_the_interpreter():
    check_worker("rope_interpreted_worker.py", 2 * 3 * 3)


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d,n", [(128, 32), (64, 128), (192, 16)])
def test_rope_kernel_compiles_for_hopper(dtype, backward, interleaved, d, n):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron.core.fusions import _triton_rope as kernels
    d_pad = triton.next_power_of_2(d)
    signature = {"x_ptr": dtype, "f_ptr": "*fp32", "out_ptr": dtype, "B": "i32", "N": "i32", "D": "i32", "ROT": "i32",
                 "stride_xs": "i32", "stride_xb": "i32", "stride_xn": "i32", "stride_fs": "i32", "mscale": "fp32",
                 "BACKWARD": "constexpr", "INTERLEAVED": "constexpr", "BLOCK_N": "constexpr", "D_PAD": "constexpr"}
    src = ASTSource(fn=kernels._rope_kernel, signature=signature,
                    constexprs=dict(BACKWARD=backward, INTERLEAVED=interleaved,
                                    BLOCK_N=max(1, min(triton.next_power_of_2(n), 4096 // d_pad)), D_PAD=d_pad))
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except (RuntimeError, FileNotFoundError, ImportError) as e:  # a Triton build without the CUDA backend
        pytest.skip(f"Triton cannot compile for CUDA here: {e}")
    assert ".entry" in kernel.asm["ptx"]


def test_cpu_tensors_take_the_other_path():
    t = torch.randn(4, 1, 2, 8)
    freqs = torch.randn(4, 1, 1, 8)
    assert not fused_rope.available(t, freqs)
