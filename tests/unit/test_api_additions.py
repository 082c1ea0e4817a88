"""MultimodalRotaryEmbedding against the per-section mRoPE formula; MTPLossLoggingHelper's
accumulation, reduction (2 gloo ranks) and logging; partition_buckets and DDP's bucket groups
(2 gloo ranks: which buckets launch together, and grads equal to the mean of the ranks' grads)."""
import math

import pytest
import torch

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding, RotaryEmbedding
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from tests.parallel.dist_utils import run_distributed

KV, SECTION, BASE = 16, [2, 3, 3], 10000  # rot_dim / 2 = 8 frequency bands: 2 temporal, 3 height, 3 width


def _positions(b=2, s=6, seed=0):
    return torch.randint(0, 50, (3, b, s), generator=torch.Generator().manual_seed(seed))


def _reference(q, pos, interleaved):
    """Rotate each channel pair (j, j + d/2), or (2j, 2j+1) interleaved, by pos[c(j)] * base^(-2j/d),
    c(j) the section (t, h, w) that band j falls in. q: [s, b, n, d]; pos: [3, b, s]."""
    d = q.shape[-1]
    out = q.clone()
    for j in range(d // 2):
        c = 0 if j < SECTION[0] else 1 if j < SECTION[0] + SECTION[1] else 2
        angle = pos[c].t().double()[:, :, None] * BASE ** (-2 * j / d)  # [s, b, 1]
        cos, sin = torch.cos(angle), torch.sin(angle)
        a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + d // 2)
        x, y = q[..., a].double(), q[..., b].double()
        out[..., a], out[..., b] = (x * cos - y * sin).float(), (y * cos + x * sin).float()
    return out


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_matches_per_section_formula(interleaved):
    rope = MultimodalRotaryEmbedding(KV, 1.0, rotary_interleaved=interleaved, rotary_base=BASE)
    pos = _positions()
    emb = rope(pos, SECTION)
    assert emb.shape == (6, 2, 1, KV)
    q = torch.randn(6, 2, 3, KV, generator=torch.Generator().manual_seed(1))
    # float32 angles (positions < 50) and sin/cos: ~1e-5 absolute on O(1) values.
    torch.testing.assert_close(apply_rotary_pos_emb(q, emb, rotary_interleaved=interleaved),
                               _reference(q, pos, interleaved), atol=2e-5, rtol=1e-5)


def test_mrope_text_tokens_are_plain_rope_and_interpolation():
    """Equal (t, h, w) positions: every band sees the same position, i.e. 1-D RoPE."""
    s = 10
    pos = torch.arange(s).expand(3, 1, s)
    torch.testing.assert_close(MultimodalRotaryEmbedding(KV, 1.0)(pos, SECTION), RotaryEmbedding(KV, 1.0)(s))
    torch.testing.assert_close(MultimodalRotaryEmbedding(KV, 1.0, seq_len_interpolation_factor=2.0)(pos, SECTION),
                               RotaryEmbedding(KV, 1.0, seq_len_interpolation_factor=2.0)(s))
    with pytest.raises(ValueError, match="must sum to rot_dim / 2 = 8"):
        MultimodalRotaryEmbedding(KV, 1.0)(pos, [2, 2, 2])


class _Recorder:
    """Collects what a TensorBoard / W&B writer receives."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, step):
        self.scalars[(name, step)] = float(value)

    def log(self, values, step):
        for name, value in values.items():
            self.scalars[(name, step)] = float(value)


def test_mtp_logging_helper_single_process():
    H = MTPLossLoggingHelper
    H.tracker.clear()
    # Two micro-batches, two depths: loss, correct predictions, valid positions.
    for loss, correct, total in ((0.5, 3, 4), (1.5, 1, 4)):
        H.save_metrics_to_tracker(torch.tensor(loss), torch.tensor(float(correct)), torch.tensor(float(total)), 0, 2)
        H.save_metrics_to_tracker(torch.tensor(2 * loss), torch.tensor(0.0), torch.tensor(0.0), 1, 2)
    H.save_metrics_to_tracker(torch.tensor(9.0), torch.tensor(1.0), torch.tensor(1.0), None, 2)  # not logged
    writer, wandb, totals = _Recorder(), _Recorder(), {"mtp_1 loss": torch.tensor(1.0)}
    H.track_mtp_metrics(0.5, 7, writer, wandb, totals)
    assert writer.scalars == wandb.scalars
    assert writer.scalars[("mtp_1 loss", 7)] == 1.0 and writer.scalars[("mtp_2 loss", 7)] == 2.0
    assert writer.scalars[("mtp_1_acceptance_rate", 7)] == 50.0
    assert writer.scalars[("mtp_2_acceptance_rate", 7)] == 0.0  # no valid position: 0, not NaN
    assert float(totals["mtp_1 loss"]) == 2.0 and float(totals["mtp_2 loss"]) == 2.0
    assert float(H.tracker["loss_values"].abs().sum()) == 0.0  # cleaned for the next iteration
    H.save_metrics_to_tracker(torch.tensor(1.0), torch.tensor(4.0), torch.tensor(4.0), 0, 2)
    H.track_mtp_metrics(1.0, 8, writer)
    assert writer.scalars[("mtp_1_acceptance_rate", 8)] == 100.0
    assert math.isclose(writer.scalars[("mtp_1_cumulative_acceptance_rate", 8)], 8 / 12 * 100.0, rel_tol=1e-6)
    H.tracker.clear()


def _two_ranks():
    rank = torch.distributed.get_rank()
    world = torch.distributed.group.WORLD
    H = MTPLossLoggingHelper
    H.save_metrics_to_tracker(torch.tensor(float(rank + 1)), torch.tensor(float(rank)), torch.tensor(2.0), 0, 1,
                              avg_group=world)
    writer = _Recorder()
    H.track_mtp_metrics(1.0, 1, writer)
    H.save_metrics_to_tracker(torch.tensor(float(rank + 1)), torch.tensor(1.0), torch.tensor(1.0), 0, 1,
                              reduce_group=world)
    H.track_mtp_metrics(1.0, 2, writer)
    # Context parallel: this rank's chunks (r, 2CP-1-r) of the 2CP-chunked sequence.
    pos = _positions(b=1, s=8)
    local = MultimodalRotaryEmbedding(KV, 1.0, cp_group=world)(pos, SECTION)
    full = MultimodalRotaryEmbedding(KV, 1.0)(pos, SECTION, cp_group=None)
    return writer.scalars, local, full, _bucket_groups()


def _net():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    net[1].to(torch.float64)  # a second dtype: a second buffer
    for p in net.parameters():
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = False, -1, 1
    return net


def _grads(net, x):
    """Plain autograd grads of one rank's batch (the reference)."""
    net.zero_grad()
    net[1](net[0](x).double()).sum().backward()
    return [p.grad.clone() for p in net.parameters()]


def _bucket_groups():
    """DDP with overlap: tiny buckets (one per param) in two buffers."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import partition_buckets
    parallel_state.initialize_model_parallel(1, 1)
    rank = torch.distributed.get_rank()
    cfg = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=1)
    out = {}
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    for disable in (False, True):
        model = DistributedDataParallel(None, cfg, _net(), disable_bucketing=disable)
        buckets = [b for buf in model.buffers for b in buf.buckets]
        sizes = [len(g.buckets) for g in model.bucket_groups]
        model.zero_grad_buffer()
        model.module[1](model.module[0](xs[rank]).double()).sum().backward()
        launched = all(b.grad_reduce_handle is not None for b in buckets)  # by the hooks, in backward
        model.finish_grad_sync()
        out[disable] = (len(model.buffers), len(buckets), sizes, launched,
                        [p.main_grad.clone() for p in model.module.parameters()])
        assert len(partition_buckets(model.buffers, force_single_bucket_group=True)) == 1
    ref = [(a + b) / 2 for a, b in zip(*[_grads(_net(), x) for x in xs])]
    return out, ref


def test_mtp_logging_reduction_and_mrope_cp_on_two_ranks():
    (s0, local0, full, (groups, ref)), (s1, local1, _, _) = run_distributed(_two_ranks, 2)
    assert s0 == s1
    assert s0[("mtp_1 loss", 1)] == 1.5  # averaged over the group
    assert s0[("mtp_1_acceptance_rate", 1)] == 25.0  # counts summed: 1 of 4
    assert s0[("mtp_1 loss", 2)] == 3.0  # summed over the reduce group
    assert math.isclose(s0[("mtp_1_cumulative_acceptance_rate", 2)], 3 / 6 * 100.0)
    torch.testing.assert_close(local0, torch.cat([full[0:2], full[6:8]]))
    torch.testing.assert_close(local1, torch.cat([full[2:4], full[4:6]]))

    # partition_buckets: one group per bucket (2 buffers, 1 bucket per param with bucket_size=1), or with
    # disable_bucketing (one bucket per buffer) both buffers' buckets in one group; grads reduced either way.
    for disable, (num_buffers, num_buckets, sizes, launched, grads) in groups.items():
        assert num_buffers == 2 and num_buckets == (2 if disable else 4) and launched
        assert sizes == ([2] if disable else [1, 1, 1, 1])
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r.to(g.dtype), rtol=1e-6, atol=1e-6)  # the mean of two sums


def test_qb_dual_update_against_per_column_quantiles():
    """Indices: each token's k best biased scores (by sorting); new bias: per expert, the (target+1)-th
    largest of scores - alpha over tokens (alpha: each token's (k+1)-th best biased score)."""
    from megatron.core.transformer.moe.moe_utils import qb_dual_update
    m, n, k = 12, 4, 2
    g = torch.Generator().manual_seed(3)
    scores, beta = torch.randn(m, n, generator=g), torch.randn(n, generator=g) * 0.1
    indices, new_beta = qb_dual_update(scores, k, beta)
    biased = (scores - beta).tolist()
    alpha = []
    for t in range(m):
        order = sorted(range(n), key=lambda j: -biased[t][j])
        assert indices[t].tolist() == order[:k]
        alpha.append(biased[t][order[k]])
    target = m * k // n  # tokens per expert
    expected = [sorted((float(scores[t, j]) - alpha[t] for t in range(m)), reverse=True)[target] for j in range(n)]
    torch.testing.assert_close(new_beta, torch.tensor(expected))
    same_indices, unchanged = qb_dual_update(scores, k, beta, update_beta=False)
    assert torch.equal(same_indices, indices) and unchanged is beta
    with pytest.raises(ValueError, match="do not split evenly"):
        qb_dual_update(scores[:11], k, beta)
