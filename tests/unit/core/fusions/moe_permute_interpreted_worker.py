"""Run by test_moe_permute.py with TRITON_INTERPRET=1 (set before Triton loads): the fused permutation
(`moe_utils._fused_permute` / `_fused_unpermute`, the kernels of `megatron/core/fusions/moe_permute.py`) on CPU
against the eager `_permute` / `_unpermute`, forward and backward, with and without routing probabilities, in
fp32 and bf16, on shapes with empty experts, k = 1 and hidden sizes past one block of the kernels' loop.
Prints "name error tolerance" per compared tensor."""
import torch

from megatron.core.fusions import moe_permute
from megatron.core.transformer.moe import moe_utils

moe_permute.available = lambda tokens, num_experts=1: True  # the interpreter runs the kernels on CPU tensors


def routing(tokens, experts, k, gen):
    scores = torch.rand(tokens, experts, generator=gen)
    top = scores.topk(k, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.softmax(torch.randn(tokens, experts, generator=gen), dim=1) * routing_map
    return routing_map, probs


def run(permute, unpermute, x, routing_map, probs, k, scale_rows, grad_out, grad_rows_extra):
    x = x.clone().requires_grad_(True)
    p = None if probs is None else probs.clone().requires_grad_(True)
    rows, rows_probs, sorted_indices = permute(x, routing_map, p, num_out_tokens=x.shape[0] * k, topk=k)
    y = rows * 1.5 + grad_rows_extra  # the experts: a differentiable map of the rows
    out = unpermute(y, sorted_indices, x.shape, probs=rows_probs if scale_rows else None, topk=k)
    loss = (out.float() * grad_out).sum()
    if rows_probs is not None and not scale_rows:
        loss = loss + (rows_probs.float() * torch.arange(rows_probs.numel()).float()).sum()
    loss.backward()
    return dict(rows=rows, sorted=sorted_indices, out=out, dx=x.grad,
                **({} if p is None else dict(rows_probs=rows_probs, dprobs=p.grad)))


def main():
    gen = torch.Generator().manual_seed(0)
    # Moved values (rows, probs, sorted_indices) must be equal; sums agree to fp32 rounding, and in bf16 to a
    # few units in the last place (the eager side rounds after its multiply, the kernels once after the fp32 sum).
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        for tokens, experts, k, hidden in ((13, 6, 2, 40), (7, 16, 8, 24), (9, 4, 1, 8), (6, 5, 3, 1100)):
            routing_map, probs = routing(tokens, experts, k, gen)
            x = torch.randn(tokens, hidden, generator=gen).to(dtype)
            grad_out = torch.randn(tokens, hidden, generator=gen)
            extra = torch.randn(tokens * k, hidden, generator=gen).to(dtype)
            for with_probs, scale_rows in ((False, False), (True, False), (True, True)):
                args = (x, routing_map, probs if with_probs else None, k, scale_rows, grad_out, extra)
                fused = run(moe_utils._fused_permute, moe_utils._fused_unpermute, *args)
                eager = run(moe_utils._permute, moe_utils._unpermute, *args)
                case = (f"{str(dtype).split('.')[-1]}-T{tokens}-E{experts}-k{k}-h{hidden}"
                        f"-probs{int(with_probs)}{int(scale_rows)}")
                assert fused["sorted"].dtype == torch.int64 and hasattr(fused["sorted"], "token_rows"), case
                for name, ref in eager.items():
                    got = fused[name]
                    if name in ("sorted", "rows", "rows_probs"):
                        print(f"{case}-{name} {float((got != ref).sum()):.3e} 0")
                        continue
                    err = ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()
                    print(f"{case}-{name} {err:.3e} {tol}")


if __name__ == "__main__":
    main()
