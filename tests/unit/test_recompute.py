"""Activation recompute flags: parsed, mapped to the config, and training losses identical with and without."""
import pytest
import torch

from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
from tests.fixtures.tiny_gpt import tiny_gpt

BASE = ("--num-layers 3 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 2 --train-iters 3 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 63 --hidden-dropout 0.1 --attention-dropout 0.1").split()
VARIANTS = {
    "selective-default": "--recompute-activations",
    "selective-all": "--recompute-granularity selective --recompute-modules core_attn mlp layernorm",
    "full-uniform": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    "full-block": "--recompute-granularity full --recompute-method block --recompute-num-layers 2",
}


def _config(extra):
    args = validate_args(parse_args(argv=BASE + extra.split()))
    return core_transformer_config_from_args(args)


def _train_losses(config, steps=3):
    """Losses of a few AdamW steps on fixed data; dropout on, replayed identically by recompute."""
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = tiny_gpt(config, max_sequence_length=8, share_embeddings_and_output_weights=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 8), generator=g)
    pos = torch.arange(8).expand(2, 8)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(ids, pos, None, labels=ids).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_flags_reach_config():
    c = _config(VARIANTS["selective-default"])
    assert c.recompute_granularity == "selective" and c.recompute_modules == ["core_attn"]
    c = _config(VARIANTS["selective-all"])
    assert c.recompute_modules == ["core_attn", "mlp", "layernorm"]
    c = _config(VARIANTS["full-block"])
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "block", 2)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_recompute_losses_identical(name):
    reference = _train_losses(_config(""))
    # Recompute replays the same kernels on the same inputs with the same RNG state: bitwise equal on CPU.
    assert _train_losses(_config(VARIANTS[name])) == reference


def test_recompute_method_without_full_rejected():
    with pytest.raises(Exception, match="recompute"):
        _config("--recompute-method uniform")
