"""A model provider written like Megatron-LM's GPT example (tests/parallel/megatron_gpt_builder.py: TE-named
layer spec, decoder block spec for MoE, MTP block spec, GPTModel) trains through pretrain() at TP=2 on gloo
and gives, iteration by iteration, the losses of pretrain_gpt.py's own provider (same modules, same seed:
equal to fp32 rounding, relative 1e-6). Two models: MoE + MTP through the flags as given, and a dense one
with MTP where the builder is handed args with transformer_impl 'transformer_engine' (its
get_gpt_layer_with_transformer_engine_spec path; the flag itself is refused here, Transformer Engine
being absent)."""
import pytest

from tests.fixtures.tiny_gpt import mock_data_cache, run_pretrain
from tests.parallel.dist_utils import run_distributed

COMMON = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --tokenizer-type NullTokenizer --mock-data --lr 1e-3 --train-iters 3 "
         "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0 --num-workers 0 "
         "--micro-batch-size 2 --global-batch-size 4 --seed 1234 --tensor-model-parallel-size 2 "
          "--sequence-parallel --mtp-num-layers 1 --disable-bias-linear --position-embedding-type rope ")
MOE = (COMMON + "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01").split()
DENSE = COMMON.split()


@pytest.fixture(scope="module", autouse=True)
def _mock_data_cache(tmp_path_factory):
    """Every run of the module reads the mock data's indices built by its first run."""
    yield from mock_data_cache(tmp_path_factory)


def _losses(provider, flags):
    losses = []

    def record(model, optimizer, result):
        losses.append((float(result[0]["lm loss"]), float(result[0]["mtp_1 loss"])))

    run_pretrain(flags, record, model_provider=provider)
    return losses


def _te_impl_provider(pre_process=True, post_process=True, vp_stage=None):
    import argparse

    from megatron.training import get_args
    from tests.parallel.megatron_gpt_builder import gpt_builder
    args = argparse.Namespace(**vars(get_args()))
    args.transformer_impl = "transformer_engine"
    return gpt_builder(args, pre_process, post_process, vp_stage)


def _runs():
    import pretrain_gpt
    from tests.parallel import megatron_gpt_builder
    return [(_losses(megatron_gpt_builder.model_provider, MOE), _losses(pretrain_gpt.model_provider, MOE)),
            (_losses(_te_impl_provider, DENSE), _losses(pretrain_gpt.model_provider, DENSE))]


def test_megatron_style_provider_matches_pretrain_gpt():
    for rank_runs in run_distributed(_runs, 2):
        for theirs, ours in rank_runs:
            assert len(theirs) == len(ours) == 3
            for a, b in zip(theirs, ours):
                for x, y in zip(a, b):
                    assert abs(x - y) <= 1e-6 * abs(y), (theirs, ours)
