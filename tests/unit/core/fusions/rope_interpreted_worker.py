"""Run by test_rope_fusion.py with TRITON_INTERPRET=1: the RoPE kernel of `megatron/core/fusions/rope.py` on CPU
against the eager rotation (`rope_utils._rope`), forward and backward: half-by-half and interleaved pairs, pass-through
channels (rot_dim < d), YaRN's mscale, a strided view (the query of a fused projection), freqs whose halves differ,
heads that do not fill a block; fp32 and bf16. Prints "name error tolerance"."""
import torch

from megatron.core.fusions import rope as fused_rope
from megatron.core.models.common.embeddings import rope_utils


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def main():
    gen = torch.Generator().manual_seed(0)
    cases = {"halves": (16, 16, False, 1.0), "interleaved_pass": (24, 16, True, 1.0), "halves_pass_mscale": (40, 32,
                                                                                                        False, 1.3)}
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        for name, (d, rot, interleaved, mscale) in cases.items():
            s, b, n = 7, 2, 5
            big = torch.randn(s, b, n, d + 8, generator=gen).to(dtype)
            freqs = torch.randn(s + 3, 1, 1, rot, generator=gen) * 3  # longer than s; halves differ
            grad = torch.randn(s, b, n, d, generator=gen).to(dtype)
            outs = {}
            for way, fn in (("fused", fused_rope.rope), ("eager", rope_utils._rope)):
                t = big.clone().requires_grad_(True)
                view = t[..., :d]  # strided: the channels contiguous, the heads d + 8 apart
                f = freqs if way == "fused" else freqs[:s]
                out = fn(view, f, mscale, interleaved)
                out.backward(grad)
                outs[way] = (out, t.grad[..., :d], t.grad[..., d:])
            case = f"{str(dtype).split('.')[-1]}-{name}"
            assert outs["fused"][0].is_contiguous() and outs["fused"][0].shape == (s, b, n, d), case
            print(f"{case}-out {rel(outs['fused'][0], outs['eager'][0]):.3e} {tol}")
            print(f"{case}-grad {rel(outs['fused'][1], outs['eager'][1]):.3e} {tol}")
            print(f"{case}-grad_outside_view {outs['fused'][2].abs().max().item():.3e} 0")


if __name__ == "__main__":
    main()
