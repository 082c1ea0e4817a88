"""Run by test_grouped_wgrad.py with TRITON_INTERPRET=1 (set before Triton loads): the grouped weight-gradient
kernel on CPU against a loop of per-expert matmuls in float64, for fp32 and fp16 operands (the interpreter's bf16
dot is not exact; bf16 runs on the GPU test), written and accumulated, with empty experts, row blocks that do not
fill a K tile and output sizes that do not fill an M or N tile. Prints "name error tolerance" per case."""
import torch

from megatron.core.fusions._triton_grouped_wgrad import grouped_wgrad


def reference(grad, x, counts, base):
    out, start = base.double().clone(), 0
    for e, c in enumerate(counts):
        out[e] += grad[start:start + c].double().t() @ x[start:start + c].double()
        start += c
    return out


def main():
    gen = torch.Generator().manual_seed(0)
    blocks = dict(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-3)):
        for counts, m, n in (([5, 0, 70], 40, 24), ([16, 32], 16, 16), ([0, 0, 3], 8, 40)):
            rows = sum(counts)
            grad = torch.randn(rows, m, generator=gen).to(dtype)
            x = torch.randn(rows, n, generator=gen).to(dtype)
            offs = torch.tensor(counts).cumsum(0).to(torch.int32)
            for accumulate in (False, True):
                base = torch.randn(len(counts), m, n, generator=gen)
                out = base.clone()
                grouped_wgrad(out, grad, x, offs, accumulate, **blocks)
                ref = reference(grad, x, counts, base if accumulate else torch.zeros_like(base))
                err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                case = f"{str(dtype).split('.')[-1]}-{'_'.join(map(str, counts))}-{m}x{n}"
                print(f"{case}-{'add' if accumulate else 'write'} {err:.3e} {tol}")


if __name__ == "__main__":
    main()
