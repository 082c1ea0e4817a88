"""The grouped weight-gradient kernel compiles for Hopper (sm_90) without a GPU, into the code its speed depends on:
wgmma tensor-core instructions fed by asynchronous copies (the software-pipelined loop over each expert's rows),
for every tile configuration the first call times. Arguments are specialised as a launch on real tensors would
be (16-byte aligned pointers, sizes and strides divisible by 16)."""
import pytest

triton = pytest.importorskip("triton")


def test_every_tile_configuration_compiles_to_pipelined_wgmma():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron.core.fusions._triton_grouped_wgrad import CONFIGS, _grouped_wgrad_kernel
    signature = {"g_ptr": "*bf16", "x_ptr": "*bf16", "c_ptr": "*fp32", "offs_ptr": "*i32", "M": "i32", "N": "i32",
                 "stride_gr": "i32", "stride_xr": "i32", "stride_ce": "i32", "stride_cm": "i32",
                 "ACCUMULATE": "constexpr", "IEEE": "constexpr", "INTERPRETED": "constexpr",
                 "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(10)}
    for block_m, block_n, block_k, warps, stages in CONFIGS:
        src = ASTSource(fn=_grouped_wgrad_kernel, signature=signature, attrs=aligned,
                        constexprs={"ACCUMULATE": True, "IEEE": False, "INTERPRETED": False, "BLOCK_M": block_m,
                                    "BLOCK_N": block_n, "BLOCK_K": block_k})
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": warps, "num_stages": stages})
        except (RuntimeError, FileNotFoundError, ImportError) as e:  # a Triton build without the CUDA backend
            pytest.skip(f"Triton cannot compile for CUDA here: {e}")
        ptx = kernel.asm["ptx"]
        config = (block_m, block_n, block_k, warps, stages)
        assert "wgmma.mma_async" in ptx and "cp.async" in ptx, f"tiles {config}: not a pipelined wgmma loop"
        per_stage = (block_m + block_n) * block_k * 2  # bf16 tiles of G and X
        assert kernel.metadata.shared >= stages * per_stage, f"tiles {config}: fewer buffered stages than asked"
        assert kernel.metadata.shared <= 227 * 1024, f"tiles {config}: more shared memory than an H100 SM has"
