"""A checkpoint loads under a TP size that pads the vocabulary differently.

The padded vocab is a multiple of make_vocab_size_divisible_by x TP (Megatron's rule), so the
embedding's global shape changes with TP. Loading must read the rows both layouts have (weights and
Adam moments) instead of failing on the shape.
"""
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt, train_step
from tests.parallel.dist_utils import run_distributed

TRUE_VOCAB, DIVISIBLE_BY, SEQ = 70, 16, 8


def _padded(tp):
    multiple = DIVISIBLE_BY * tp
    return -(-TRUE_VOCAB // multiple) * multiple  # TP=1: 80, TP=2: 96, TP=4: 128


def _build(tp):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    cfg = tiny_config(tensor_model_parallel_size=tp)
    gpt = tiny_gpt(cfg, vocab_size=_padded(tp), max_sequence_length=SEQ)
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), gpt)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.0), [model])
    return model, opt


def _full_embedding(model):
    """The TP-gathered embedding weight, [padded vocab, h]."""
    weight = model.module.embedding.word_embeddings.weight.detach()
    parts = [torch.empty_like(weight) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, weight.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts)


def _save_then_load(ckpt, save_tp, load_tp):
    from megatron.core import dist_checkpointing

    model, opt = _build(save_tp)
    tokens = torch.randint(0, TRUE_VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        train_step(model, opt, [tokens], seq=SEQ)
    sd = model.module.sharded_state_dict()
    dist_checkpointing.save({"model": sd, "optimizer": opt.sharded_state_dict(sd)}, ckpt)
    saved_weight = _full_embedding(model)
    ps.destroy_model_parallel()

    model, opt = _build(load_tp)
    sd = model.module.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": sd, "optimizer": opt.sharded_state_dict(sd, is_loading=True)}, ckpt)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    got_weight = _full_embedding(model)  # the optimizer state loaded too
    ps.destroy_model_parallel()
    rows = min(saved_weight.shape[0], got_weight.shape[0])
    return saved_weight[:rows], got_weight[:rows], got_weight.shape[0]


def test_tp2_checkpoint_loads_at_tp4_and_tp1(tmp_path):
    for load_tp in (4, 1):
        results = run_distributed(_save_then_load, 4, f"{tmp_path}/to_tp{load_tp}", 2, load_tp)
        for saved, got, padded in results:
            assert padded == _padded(load_tp)
            torch.testing.assert_close(got, saved, rtol=0, atol=0)
