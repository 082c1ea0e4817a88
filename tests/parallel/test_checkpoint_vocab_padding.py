"""A checkpoint loads under a TP size that pads the vocabulary differently.

The padded vocab is a multiple of make_vocab_size_divisible_by x TP (Megatron's rule), so the
embedding's global shape changes with TP. Loading must read the rows both layouts have (weights and
Adam moments) instead of failing on the shape.
"""
import torch

from megatron.core import parallel_state as ps
from tests.parallel.dist_utils import run_distributed

TRUE_VOCAB, DIVISIBLE_BY, SEQ = 70, 16, 8


def _padded(tp):
    multiple = DIVISIBLE_BY * tp
    return -(-TRUE_VOCAB // multiple) * multiple  # TP=1: 80, TP=2: 96, TP=4: 128


def _build(tp):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=tp,
                            hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(), _padded(tp), SEQ, share_embeddings_and_output_weights=True)
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
        model.zero_grad_buffer()
        loss = model(tokens[:, :-1], torch.arange(SEQ).expand(2, SEQ), None, labels=tokens[:, 1:]).mean()
        loss.backward()
        model.finish_grad_sync()
        opt.step()
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
