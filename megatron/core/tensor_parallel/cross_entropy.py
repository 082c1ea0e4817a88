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


class VocabParallelCrossEntropy:
    """The steps of the vocab-parallel cross entropy, without the communication between them (callers
    all-reduce logits_max (MAX), predicted_logits and sum_exp_logits (SUM) over TP in between), so
    fused and unfused implementations share them. Logits are [*, V/tp]; targets [*]."""

    @staticmethod
    def calculate_logits_max(vocab_parallel_logits):
        """-> (fp32 logits, local max over the vocab chunk)."""
        logits = vocab_parallel_logits.float()
        return logits, logits.max(dim=-1)[0]

    @staticmethod
    def calculate_predicted_logits(vocab_parallel_logits, target, logits_max, vocab_start_index, vocab_end_index):
        """Shift by the (global) max; pick this rank's target logits (0 where the target lies elsewhere).
        -> (target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits)."""
        logits = vocab_parallel_logits - logits_max.unsqueeze(-1)
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = (target - vocab_start_index).masked_fill(target_mask, 0)
        predicted = logits.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1).masked_fill(target_mask, 0.0)
        exp_logits = logits.exp()
        return target_mask, masked_target.reshape(-1), predicted, exp_logits.sum(dim=-1), exp_logits

    @staticmethod
    def calculate_cross_entropy_loss(exp_logits, predicted_logits, sum_exp_logits):
        """loss = log(sum exp) - target logit (global sums). -> (softmax, in place of exp_logits; loss)."""
        loss = sum_exp_logits.log() - predicted_logits
        return exp_logits.div_(sum_exp_logits.unsqueeze(-1)), loss

    @staticmethod
    def prepare_gradient_calculation_operands(softmax, target_mask):
        """-> (grad_2d view of softmax, row indices, 1 where this rank holds the target, grad_input)."""
        grad_2d = softmax.view(-1, softmax.size(-1))
        arange_1d = torch.arange(grad_2d.size(0), device=grad_2d.device)
        return grad_2d, arange_1d, 1.0 - target_mask.reshape(-1).float(), softmax

    @staticmethod
    def calculate_gradients(grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output):
        """d loss / d z = softmax - onehot(target), times the incoming gradient (in place)."""
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        return grad_input.mul_(grad_output.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, group):
        steps = VocabParallelCrossEntropy
        logits, logits_max = steps.calculate_logits_max(vocab_parallel_logits)  # [s, b, V/tp] fp32
        _all_reduce(logits_max, dist.ReduceOp.MAX, group)
        part = logits.size(-1)
        rank = 0 if group is None else dist.get_rank(group)
        world = 1 if group is None else dist.get_world_size(group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(part, rank, world)
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = steps.calculate_predicted_logits(
            logits, target, logits_max, start, end)
        _all_reduce(predicted, dist.ReduceOp.SUM, group)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)

        vocab_size = part * world
        smoothing = 0.0
        if label_smoothing > 0:
            if not label_smoothing < 1.0:
                raise ValueError(f"--label-smoothing must be in [0, 1), got {label_smoothing}")
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            log_probs = logits - logits_max.unsqueeze(-1) - sum_exp.log().unsqueeze(-1)
            mean_log_probs = _all_reduce(log_probs.sum(dim=-1), dist.ReduceOp.SUM, group) / vocab_size
        softmax, loss = steps.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        if smoothing > 0:
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        ctx.smoothing, ctx.vocab_size, ctx.in_dtype = smoothing, vocab_size, vocab_parallel_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        steps = VocabParallelCrossEntropy
        grad_2d, arange_1d, update, grad = steps.prepare_gradient_calculation_operands(softmax.clone(), target_mask)
        # With smoothing: d loss / d z = softmax - (1 - smoothing) * onehot(target) - smoothing / V
        if ctx.smoothing > 0:
            update = update * (1.0 - ctx.smoothing)
            grad.sub_(ctx.smoothing / ctx.vocab_size)
        grad = steps.calculate_gradients(grad_2d, arange_1d, masked_target_1d, update, grad, grad_output)
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing: float = 0.0, tp_group=None):
    """Per-token loss (fp32, shape of ``target``) from logits split over the TP group on the last dim."""
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, tp_group)
