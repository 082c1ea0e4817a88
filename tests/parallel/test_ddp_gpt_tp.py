"""GPT under TP=2 x DP=2 (sequence parallel, distributed optimizer, overlapped reduce and gather)
reproduces the TP=DP=1 loss and grad norm: the norm checks that TP-replicated params count once and
that SP partial grads are summed over TP by finalize_model_grads. fp32 on CPU: ~1e-7 relative noise."""
import pytest
import torch

from tests.parallel.dist_utils import run_distributed

ITERS, GLOBAL_BATCH, SEQ, VOCAB = 3, 4, 16, 128


def train_gpt(tp, distopt):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=tp,
                            sequence_parallel=tp > 1, hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, SEQ, share_embeddings_and_output_weights=True)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distopt, overlap_grad_reduce=distopt,
                                               overlap_param_gather=distopt, bucket_size=2000)
    model = DistributedDataParallel(cfg, ddp_config, gpt)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, clip_grad=0.5, use_distributed_optimizer=distopt,
                                                 overlap_param_gather=distopt), [model])
    gen = torch.Generator().manual_seed(0)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = GLOBAL_BATCH // dp
    losses, norms = [], []
    for _ in range(ITERS):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)[dp_rank * local:(dp_rank + 1) * local]
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = model(tokens[:, :-1], torch.arange(SEQ).expand(local, SEQ), None, labels=tokens[:, 1:]).mean()
        loss.backward()
        finalize_model_grads([model])
        ok, norm, _ = opt.step()
        report = loss.detach().clone()
        torch.distributed.all_reduce(report, group=ps.get_data_parallel_group())
        losses.append(report.item() / dp)
        norms.append(norm)
    return losses, norms


def test_tp2_dp2_distopt_matches_single_rank():
    ref_losses, ref_norms = run_distributed(train_gpt, 1, 1, False)[0]
    for losses, norms in run_distributed(train_gpt, 4, 2, True):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert norms == pytest.approx(ref_norms, rel=1e-5)
