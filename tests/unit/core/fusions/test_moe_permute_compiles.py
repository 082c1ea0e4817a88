"""--moe-permute-fusion's kernels compile for Hopper (sm_90) without a GPU, for bf16 and fp32 rows, with and without
routing probabilities, at Qwen3-30B-A3B's (128 experts, top-8) and Mixtral's (8 experts, top-2) launch constants,
and hold no atomic instruction (the sums are ordered, so the results are deterministic). The interpreter test
(test_moe_permute.py) checks their values; this one the compiler's side, which the interpreter skips."""
import re

import pytest

triton = pytest.importorskip("triton")


def _compile(fn, signature, constexprs):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    pointers = [i for i, kind in enumerate(signature.values()) if kind.startswith("*")]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in pointers})
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except (RuntimeError, FileNotFoundError, ImportError) as e:  # a Triton build without the CUDA backend
        pytest.skip(f"Triton cannot compile for CUDA here: {e}")


@pytest.mark.parametrize("rows", ["*bf16", "*fp32"])
@pytest.mark.parametrize("has_probs", [True, False])
@pytest.mark.parametrize("experts,k,hidden", [(128, 8, 2048), (8, 2, 4096)])
def test_kernels_compile_for_hopper_without_atomics(rows, has_probs, experts, k, hidden):
    from megatron.core.fusions import _triton_moe_permute as kernels
    launch = kernels._launch_args(hidden, k)
    common = {"K": launch["K"], "HAS_PROBS": has_probs, "K_PAD": launch["K_PAD"], "BLOCK_H": launch["BLOCK_H"]}
    probs = "*fp32"
    compiled = {
        "permute": _compile(kernels._permute_kernel, {
            "x_ptr": rows, "map_ptr": "*u8", "cum_ptr": "*i32", "offs_ptr": "*i32", "probs_ptr": probs,
            "out_ptr": rows, "out_probs_ptr": probs, "sorted_ptr": "*i64", "rows_ptr": "*i32", "experts_ptr": "*i32",
            "T": "i32", "E": "i32", "H": "i32", "K": "constexpr", "HAS_PROBS": "constexpr", "E_PAD": "constexpr",
            "K_PAD": "constexpr", "BLOCK_H": "constexpr"}, dict(common, E_PAD=triton.next_power_of_2(experts))),
        "gather_sum": _compile(kernels._gather_sum_kernel, {
            "y_ptr": rows, "rows_ptr": "*i32", "probs_ptr": probs, "out_ptr": rows, "H": "i32", "K": "constexpr",
            "HAS_PROBS": "constexpr", "K_PAD": "constexpr", "BLOCK_H": "constexpr"}, common),
        "scatter": _compile(kernels._scatter_kernel, {
            "g_ptr": rows, "rows_ptr": "*i32", "probs_ptr": probs, "y_ptr": rows, "dy_ptr": rows, "dprobs_ptr": probs,
            "H": "i32", "K": "constexpr", "HAS_PROBS": "constexpr", "K_PAD": "constexpr", "BLOCK_H": "constexpr"},
            common),
    }
    for name, kernel in compiled.items():
        ptx = kernel.asm["ptx"]
        assert ".entry" in ptx, name
        assert not re.search(r"\b(atom|red)\.", ptx), f"{name}: an atomic instruction (the sums must be ordered)"
