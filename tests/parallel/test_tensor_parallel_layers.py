"""TP layers vs their single-device torch counterparts, forward and backward, at TP=2 and TP=4.

Tolerance: fp32 on CPU; only the summation order differs (split matmuls, all-reduce), and with O(10)
values summed over ~16 terms that is a few 1e-6 absolute.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from tests.parallel.dist_utils import run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)


def _setup(tp):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo CPU test, also on GPU hosts with fewer GPUs than ranks
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(123)
    torch.manual_seed(0)  # reference tensors identical on all ranks
    return ps.get_tensor_model_parallel_rank()


def _cfg(sp=False):
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp)


def _check_linear(tp, rank, sp):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    s, b, h, f = 8, 2, 12, 16
    x = torch.randn(s, b, h)
    w1, b1, w2, b2 = torch.randn(f, h), torch.randn(f), torch.randn(h, f), torch.randn(h)
    dy = torch.randn(s, b, h)
    # Reference: y = fc2(gelu(fc1(x)))
    xr = x.clone().requires_grad_()
    ref = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
    yr = F.linear(F.gelu(F.linear(xr, ref[0], ref[1])), ref[2], ref[3])
    yr.backward(dy)

    cfg = _cfg(sp)
    fc1 = ColumnParallelLinear(h, f, config=cfg, init_method=torch.nn.init.zeros_, gather_output=False)
    fc2 = RowParallelLinear(f, h, config=cfg, init_method=torch.nn.init.zeros_, input_is_parallel=True)
    with torch.no_grad():
        fc1.weight.copy_(w1.chunk(tp, 0)[rank])
        fc1.bias.copy_(b1.chunk(tp, 0)[rank])
        fc2.weight.copy_(w2.chunk(tp, 1)[rank])
        fc2.bias.copy_(b2)
    xin = (x.chunk(tp, 0)[rank] if sp else x).clone().requires_grad_()
    y = fc2(F.gelu(fc1(xin)[0]))[0]
    y.backward(dy.chunk(tp, 0)[rank] if sp else dy)
    torch.testing.assert_close(y, yr.detach().chunk(tp, 0)[rank] if sp else yr.detach(), **TOL)
    torch.testing.assert_close(xin.grad, xr.grad.chunk(tp, 0)[rank] if sp else xr.grad, **TOL)
    torch.testing.assert_close(fc1.weight.grad, ref[0].grad.chunk(tp, 0)[rank], **TOL)
    torch.testing.assert_close(fc1.bias.grad, ref[1].grad.chunk(tp, 0)[rank], **TOL)
    torch.testing.assert_close(fc2.weight.grad, ref[2].grad.chunk(tp, 1)[rank], **TOL)
    bias_grad = fc2.bias.grad.clone()
    if sp:  # partial over the local sequence chunk: finalize_model_grads sums it over TP
        torch.distributed.all_reduce(bias_grad)
    torch.testing.assert_close(bias_grad, ref[3].grad, **TOL)
    assert fc1.weight.partition_dim == 0 and fc2.weight.partition_dim == 1
    assert fc2.bias.sequence_parallel == sp and not fc2.bias.tensor_model_parallel


def _check_gather_output(tp, rank):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    x, w, dy = torch.randn(4, 2, 6), torch.randn(8, 6), torch.randn(4, 2, 8)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(xr, wr).backward(dy)
    col = ColumnParallelLinear(6, 8, config=_cfg(), init_method=torch.nn.init.zeros_, bias=False,
                               gather_output=True)
    with torch.no_grad():
        col.weight.copy_(w.chunk(tp, 0)[rank])
    xin = x.clone().requires_grad_()
    y, _ = col(xin)
    torch.testing.assert_close(y, F.linear(x, w), **TOL)
    y.backward(dy)
    torch.testing.assert_close(xin.grad, xr.grad, **TOL)
    # Row with a full input: scatter inside.
    row = RowParallelLinear(8, 6, config=_cfg(), init_method=torch.nn.init.zeros_, bias=True,
                            input_is_parallel=False, skip_bias_add=True)
    with torch.no_grad():
        row.weight.copy_(w.t().chunk(tp, 1)[rank])
    xin2 = torch.randn(4, 2, 8)
    out, bias = row(xin2)
    torch.testing.assert_close(out, F.linear(xin2, w.t()), **TOL)
    assert bias is row.bias


def _check_embedding(tp, rank):
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    V, h, b, s = 16, 6, 2, 8
    w, ids = torch.randn(V, h), torch.randint(0, V, (b, s))
    wr = w.clone().requires_grad_()
    ref = F.embedding(ids, wr)
    dy = torch.randn(b, s, h)
    ref.backward(dy)
    for rs in (False, True):
        emb = VocabParallelEmbedding(V, h, init_method=torch.nn.init.zeros_, config=_cfg(rs),
                                     reduce_scatter_embeddings=rs)
        with torch.no_grad():
            emb.weight.copy_(w.chunk(tp, 0)[rank])
        out = emb(ids)
        if rs:  # [s/tp, b, h]
            torch.testing.assert_close(out, ref.detach().transpose(0, 1).chunk(tp, 0)[rank], **TOL)
            out.backward(dy.transpose(0, 1).chunk(tp, 0)[rank])
        else:
            torch.testing.assert_close(out, ref.detach(), **TOL)
            out.backward(dy)
        torch.testing.assert_close(emb.weight.grad, wr.grad.chunk(tp, 0)[rank], **TOL)
    # Gradient-accumulation fusion: the rows this rank owns go straight into main_grad.
    cfg = _cfg()
    cfg.gradient_accumulation_fusion = True
    emb = VocabParallelEmbedding(V, h, init_method=torch.nn.init.zeros_, config=cfg)
    emb.weight.main_grad, emb.weight.grad_added_to_main_grad = torch.zeros(V // tp, h), False
    emb(ids).backward(dy)
    torch.testing.assert_close(emb.weight.main_grad, wr.grad.chunk(tp, 0)[rank], **TOL)


def _check_cross_entropy(tp, rank):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    s, b, V = 5, 3, 16
    logits, target = torch.randn(s, b, V) * 3, torch.randint(0, V, (s, b))
    dl = torch.rand(s, b)
    for ls in (0.0, 0.1):
        lr = logits.clone().requires_grad_()
        # Megatron spreads ls over the V-1 non-target classes: torch's eps = ls * V / (V - 1).
        ref = F.cross_entropy(lr.reshape(-1, V), target.reshape(-1), reduction="none",
                              label_smoothing=ls * V / (V - 1)).view(s, b)
        ref.backward(dl)
        local = logits.chunk(tp, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, label_smoothing=ls)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, ref.detach(), **TOL)
        loss.backward(dl)
        torch.testing.assert_close(local.grad, lr.grad.chunk(tp, -1)[rank], **TOL)
    # The chunked cross entropy (--cross-entropy-loss-fusion): per-rank max and exp-sum rescaled to the
    # global max before the sum.
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    lr = logits.clone().requires_grad_()
    ref = F.cross_entropy(lr.reshape(-1, V), target.reshape(-1), reduction="none").view(s, b)
    ref.backward(dl)
    local = logits.chunk(tp, -1)[rank].clone().requires_grad_()
    loss = fused_vocab_parallel_cross_entropy(local, target)
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    loss.backward(dl)
    torch.testing.assert_close(local.grad, lr.grad.chunk(tp, -1)[rank], **TOL)


def _check_rng(tp, rank):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    shared = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        split = torch.rand(4)
    return shared.tolist(), split.tolist()


def _check_broadcast(tp, rank):
    from megatron.core.tensor_parallel import broadcast_data

    data = {"tokens": torch.arange(6).view(2, 3), "labels": torch.arange(4)} if rank == 0 else None
    out = broadcast_data(["tokens", "labels"], data, torch.int64)
    assert out["tokens"].tolist() == [[0, 1, 2], [3, 4, 5]] and out["labels"].tolist() == [0, 1, 2, 3]
    # Shapes known on every rank: one broadcast, no size exchange; a wrong shape is one line on rank 0.
    shapes = {"tokens": (2, 3), "labels": (4,)}
    out = broadcast_data(["tokens", "labels"], data, torch.int64, shapes=shapes)
    assert out["tokens"].tolist() == [[0, 1, 2], [3, 4, 5]] and out["labels"].tolist() == [0, 1, 2, 3]
    if rank == 0:
        with pytest.raises(ValueError, match="'labels' has shape \\(4,\\), the other TP ranks expect \\(5,\\)"):
            broadcast_data(["tokens", "labels"], data, torch.int64, shapes={"tokens": (2, 3), "labels": (5,)})


def _all_checks(tp):
    rank = _setup(tp)
    _check_linear(tp, rank, sp=False)
    _check_linear(tp, rank, sp=True)
    _check_gather_output(tp, rank)
    _check_embedding(tp, rank)
    _check_cross_entropy(tp, rank)
    _check_broadcast(tp, rank)
    return _check_rng(tp, rank)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_layers_match_reference(tp):
    res = run_distributed(_all_checks, tp, tp)
    shared = [r[0] for r in res]
    split = [r[1] for r in res]
    assert all(s == shared[0] for s in shared)  # default generator: same on every TP rank
    assert len({tuple(s) for s in split}) == tp  # model-parallel-rng: different per TP rank
