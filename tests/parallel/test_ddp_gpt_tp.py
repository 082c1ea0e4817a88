"""GPT under TP=2 x DP=2 (sequence parallel, distributed optimizer, overlapped reduce and gather)
reproduces the TP=DP=1 loss and grad norm: the norm checks that TP-replicated params count once and
that SP partial grads are summed over TP by finalize_model_grads. fp32 on CPU: ~1e-7 relative noise."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import SEQ, tiny_config, tiny_gpt, train_step
from tests.parallel.dist_utils import run_distributed

ITERS, GLOBAL_BATCH, VOCAB = 3, 4, 128


def train_gpt(tp, distopt):
    ps.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(1234)
    cfg = tiny_config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distopt, overlap_grad_reduce=distopt,
                                               overlap_param_gather=distopt, bucket_size=2000)
    model = DistributedDataParallel(cfg, ddp_config, tiny_gpt(cfg, vocab_size=VOCAB))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, clip_grad=0.5, use_distributed_optimizer=distopt,
                                                 overlap_param_gather=distopt), [model])
    gen = torch.Generator().manual_seed(0)
    dp_rank, local = ps.get_data_parallel_rank(), GLOBAL_BATCH // ps.get_data_parallel_world_size()
    losses, norms = [], []
    for _ in range(ITERS):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)[dp_rank * local:(dp_rank + 1) * local]
        loss, norm = train_step(model, opt, [tokens], mbs=local)  # one micro-batch per DP rank
        losses.append(loss)
        norms.append(norm)
    return losses, norms


def test_tp2_dp2_distopt_matches_single_rank():
    ref_losses, ref_norms = run_distributed(train_gpt, 1, 1, False)[0]
    for losses, norms in run_distributed(train_gpt, 4, 2, True):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert norms == pytest.approx(ref_norms, rel=1e-5)
