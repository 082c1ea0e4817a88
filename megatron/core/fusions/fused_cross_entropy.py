"""Cross entropy over (vocab-parallel) logits that never builds the full fp32 ``[s, b, V]`` tensors.

The eager reference (``tensor_parallel.vocab_parallel_cross_entropy``) upcasts the logits, keeps an fp32
softmax for backward and writes an fp32 gradient: about 5 fp32 copies of the largest activation. Here
the 16-bit logits are processed in token chunks: forward keeps only the per-token log-sum-exp (fp32,
[tokens]); backward recomputes softmax chunk by chunk and writes the gradient in the logits' dtype.
Math inside a chunk is fp32, so the result matches the reference to fp32 rounding on fp32 input.
On CUDA the per-chunk math is compiled into a few fused kernels; elsewhere it runs eagerly.
"""
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fusions.compile import maybe_compile
from megatron.core.tensor_parallel.utils import VocabUtility

_CHUNK_ELEMENTS = 1 << 28  # logits per chunk (~512 MB of fp32 temporaries on the GPU)


def _all_reduce(t, op, group):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


@maybe_compile
def _chunk_stats(logits, masked_target, target_mask):
    """(max, sum of exp(logit - max), target logit or 0 where another TP rank holds the target) per row,
    in one compiled reduction over the chunk (the max and the exp-sum need not be separate passes)."""
    z = logits.float()
    local_max = z.amax(dim=-1)  # [n]
    sum_exp = (z - local_max.unsqueeze(-1)).exp().sum(dim=-1)
    predicted = z.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1).masked_fill(target_mask, 0.0)
    return local_max, sum_exp, predicted


@maybe_compile
def _chunk_grad(logits, lse, masked_target, target_mask, grad_output):
    # d loss / d z = softmax(z) - onehot(target), scaled by the incoming per-token grad
    # The one-hot term is a comparison with the column index, not a scattered [n, V] tensor: compiled, the
    # whole gradient is one element-wise pass over the logits.
    softmax = (logits.float() - lse.unsqueeze(-1)).exp()
    cols = torch.arange(logits.size(-1), device=logits.device)
    onehot = (cols == masked_target.unsqueeze(-1)) & ~target_mask.unsqueeze(-1)
    return ((softmax - onehot.float()) * grad_output.unsqueeze(-1)).to(logits.dtype)


def _chunks(n_rows: int, vocab: int):
    """Near-equal row spans (few distinct shapes, so few compiled variants)."""
    count = max(1, -(-n_rows * vocab // _CHUNK_ELEMENTS))
    rows = -(-n_rows // count)
    return [(i, min(n_rows, i + rows)) for i in range(0, n_rows, rows)]


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        shape = target.shape
        vocab_part = logits.size(-1)
        z = logits.reshape(-1, vocab_part)  # [n, V/tp]
        t = target.reshape(-1)
        rank = 0 if group is None else dist.get_rank(group)
        world = 1 if group is None else dist.get_world_size(group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(vocab_part, rank, world)
        target_mask = (t < start) | (t >= end)
        masked_target = (t - start).masked_fill(target_mask, 0)

        spans = _chunks(z.size(0), vocab_part)
        parts = [_chunk_stats(z[a:b], masked_target[a:b], target_mask[a:b]) for a, b in spans]
        local_max, sum_exp, predicted = (torch.cat(p) if len(spans) > 1 else p[0] for p in zip(*parts))
        logits_max = _all_reduce(local_max.clone(), dist.ReduceOp.MAX, group)
        if world > 1:  # rescale each rank's exp-sum from its own max to the global one before summing
            sum_exp = sum_exp * (local_max - logits_max).exp()
        sum_exp = _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        predicted = _all_reduce(predicted, dist.ReduceOp.SUM, group)
        lse = sum_exp.log() + logits_max  # [n] fp32
        loss = lse - predicted
        ctx.save_for_backward(logits, lse, masked_target, target_mask)
        ctx.spans = spans
        return loss.view(shape)

    @staticmethod
    def backward(ctx, grad_output):
        logits, lse, masked_target, target_mask = ctx.saved_tensors
        z = logits.reshape(-1, logits.size(-1))
        g = grad_output.reshape(-1).float()
        grad = torch.empty_like(z)
        for a, b in ctx.spans:
            grad[a:b] = _chunk_grad(z[a:b], lse[a:b], masked_target[a:b], target_mask[a:b], g[a:b])
        return grad.view_as(logits), None, None


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group=None):
    """Per-token loss (fp32, shape of ``target``) from 16- or 32-bit logits split over TP on the last dim."""
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    return _FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group)


# ---- Megatron's building blocks of its fused cross entropy (same math, same in-place updates), for code
# that assembles its own vocab-parallel loss from them. The whole-tensor fp32 steps are what the chunked
# function above avoids.

def calculate_logits_max(vocab_parallel_logits: torch.Tensor):
    """(logits as fp32, their max over the local vocab slice [..])."""
    logits = vocab_parallel_logits.float()
    return logits, logits.amax(dim=-1)


def calculate_predicted_logits(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, logits_max: torch.Tensor,
                               vocab_start_index: int, vocab_end_index: int):
    """(target_mask, masked_target_1d, cat([target logit - max, sum exp]) to all-reduce, exp(logits - max)).

    Shifts ``vocab_parallel_logits`` by the (all-reduced) max and exponentiates it in place. Targets outside
    [vocab_start_index, vocab_end_index) contribute 0 here (another TP rank holds them)."""
    vocab_parallel_logits -= logits_max.unsqueeze(-1)
    target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
    masked_target_1d = (target - vocab_start_index).masked_fill(target_mask, 0).reshape(-1)
    logits_2d = vocab_parallel_logits.view(-1, vocab_parallel_logits.size(-1))
    predicted = logits_2d.gather(1, masked_target_1d.unsqueeze(1)).view_as(target).masked_fill(target_mask, 0.0)
    exp_logits = torch.exp(vocab_parallel_logits, out=vocab_parallel_logits)
    return target_mask, masked_target_1d, torch.cat((predicted, exp_logits.sum(dim=-1))), exp_logits


def calculate_cross_entropy_loss(exp_logits: torch.Tensor, predicted_logits_sum_exp_logits: torch.Tensor):
    """(softmax, written over exp_logits in place; loss = log(sum exp) - target logit) after the all-reduce."""
    predicted, sum_exp = torch.split(predicted_logits_sum_exp_logits, predicted_logits_sum_exp_logits.size(0) // 2)
    loss = torch.log(sum_exp) - predicted
    exp_logits.div_(sum_exp.unsqueeze(-1))
    return exp_logits, loss


def calculate_gradients(softmax: torch.Tensor, grad_output: torch.Tensor, target_mask: torch.Tensor,
                        masked_target_1d: torch.Tensor) -> torch.Tensor:
    """d loss / d logits = (softmax - onehot(target)) * grad_output, computed in place over ``softmax``;
    returned in bf16, as Megatron's fused path (built for bf16 training) does."""
    grad_2d = softmax.view(-1, softmax.size(-1))
    rows = torch.arange(grad_2d.size(0), device=grad_2d.device)
    grad_2d[rows, masked_target_1d] -= 1.0 - target_mask.view(-1).float()
    softmax.mul_(grad_output.unsqueeze(-1))
    return softmax.to(torch.bfloat16)
