"""Cross entropy over vocab-parallel logits without gathering the full vocabulary.

Each rank holds logits for a contiguous vocab range. Three all-reduces over TP (max, target logit,
sum of exp) give loss = log(sum exp(z - max)) - (z_target - max). Math is in fp32.
Label smoothing follows Megatron: the target keeps 1 - ls, the other V - 1 classes share ls.
"""
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import VocabUtility


def _all_reduce(t, op, group):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, group):
        logits = vocab_parallel_logits.float()  # [s, b, V/tp] (any leading dims)
        logits_max = _all_reduce(logits.max(dim=-1)[0], dist.ReduceOp.MAX, group)
        logits = logits - logits_max.unsqueeze(-1)

        part = logits.size(-1)
        rank = 0 if group is None else dist.get_rank(group)
        world = 1 if group is None else dist.get_world_size(group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(part, rank, world)
        target_mask = (target < start) | (target >= end)
        masked_target = (target - start).masked_fill(target_mask, 0)
        predicted = logits.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1)
        predicted = _all_reduce(predicted.masked_fill(target_mask, 0.0), dist.ReduceOp.SUM, group)

        exp_logits = logits.exp()
        sum_exp = _all_reduce(exp_logits.sum(dim=-1), dist.ReduceOp.SUM, group)
        loss = sum_exp.log() - predicted

        vocab_size = part * world
        smoothing = 0.0
        if label_smoothing > 0:
            if not label_smoothing < 1.0:
                raise ValueError(f"--label-smoothing must be in [0, 1), got {label_smoothing}")
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            log_probs = logits - sum_exp.log().unsqueeze(-1)
            mean_log_probs = _all_reduce(log_probs.sum(dim=-1), dist.ReduceOp.SUM, group) / vocab_size
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, target_mask, masked_target)
        ctx.smoothing, ctx.vocab_size, ctx.in_dtype = smoothing, vocab_size, vocab_parallel_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target = ctx.saved_tensors
        # d loss / d z = softmax - (1 - smoothing) * onehot(target) - smoothing / V
        grad = softmax.clone()
        onehot_scale = (1.0 - ctx.smoothing) * (~target_mask).float()
        grad.scatter_add_(-1, masked_target.unsqueeze(-1), -onehot_scale.unsqueeze(-1))
        if ctx.smoothing > 0:
            grad.sub_(ctx.smoothing / ctx.vocab_size)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing: float = 0.0, tp_group=None):
    """Per-token loss (fp32, shape of ``target``) from logits split over the TP group on the last dim."""
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, tp_group)
