"""Megatron 0.19's config-container API: parse_and_validate_args -> gpt_config_from_args ->
pretrain_cfg_container_from_args -> pretrain(cfg, ...), the pattern of code written for Megatron Core
0.19.2. The model built by GPTModelConfig's builder trains exactly like pretrain_gpt.py's model_provider
(same initialization, same losses); a container without a model uses the model_provider given."""
import re
import sys

import pytest

from tests.functional.cli_runner import CliRunner

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 2 --lr 1e-3 --mock-data --vocab-size 100 --log-interval 1 "
         "--eval-interval 100 --eval-iters 0 --num-workers 0 --train-iters 3 --swiglu --normalization RMSNorm "
         "--position-embedding-type rope --untie-embeddings-and-output-weights").split()
LOSS = re.compile(r"iteration +(\d+)/ +3 \|.*\| lm loss: (\S+) \|")

DRIVER = """
import os, sys, warnings
import pretrain_gpt
from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
model_cfg = None if os.environ.get("NO_MODEL_CFG") else gpt_config_from_args(args)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cfg = pretrain_cfg_container_from_args(args, model_cfg)
print("model config warning:", any("ModelConfig" in str(w.message) for w in caught))
assert cfg.train.global_batch_size == 2 and cfg.checkpoint.save_optim and cfg.scheduler.lr_decay_style == "linear"
pretrain(cfg, pretrain_gpt.train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
         pretrain_gpt.forward_step, model_provider=pretrain_gpt.model_provider)
"""


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


def _run(cli, argv, **env):
    """One process running ``argv`` (a script and its flags) as `__main__`, forked from the module's CliRunner."""
    (res,) = cli.run(argv, timeout=300, env=env)
    assert res.rc == 0, res.out[-3000:] + res.err[-3000:]
    return res.out, {int(m.group(1)): m.group(2) for m in LOSS.finditer(res.out)}


@pytest.fixture(scope="module")
def classic(cli):
    return _run(cli, ["pretrain_gpt.py"] + FLAGS + ["--tokenizer-type", "NullTokenizer"])[1]


def test_pretrain_with_gpt_model_config(cli, classic, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out, losses = _run(cli, [str(driver)] + FLAGS)
    assert sorted(classic) == [1, 2, 3] and losses == classic
    assert "model config warning: False" in out
    out, losses = _run(cli, [str(driver)] + FLAGS, NO_MODEL_CFG="1")
    assert losses == classic and "model config warning: True" in out


def test_containers_and_gpt_model_config_in_process(monkeypatch):
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        inference_cfg_container_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.models import GPTModelBuilder, GPTModelConfig
    monkeypatch.setattr(sys, "argv", ["x"] + FLAGS + ["--tokenizer-type", "NullTokenizer", "--no-load-optim",
                                                      "--inference-max-seq-length", "64"])
    args = validate_args(parse_args())
    cfg = inference_cfg_container_from_args(args)
    assert isinstance(cfg.model, GPTModelConfig) and cfg.inference.inference_max_seq_length == 64
    assert cfg.checkpoint.load_optim is False and cfg.checkpoint.save_optim is True
    assert cfg.tokenizer.tokenizer_type == "NullTokenizer" and cfg.rng.seed == args.seed
    pre = pretrain_cfg_container_from_args(args, cfg.model)
    assert pre.optimizer.lr == 1e-3 and pre.train.train_iters == 3 and pre.logger.log_interval == 1
    model_cfg = gpt_config_from_args(args)
    # TransformerConfig attributes read and write through the model config.
    assert model_cfg.hidden_size == 32 and model_cfg.seq_length == 16 and model_cfg.should_pad_vocab
    model_cfg.hidden_dropout = 0.0
    assert model_cfg.transformer.hidden_dropout == 0.0
    model = GPTModelBuilder(model_cfg).build_model(None, pre_process=True, post_process=True)
    assert model.embedding.word_embeddings.weight.shape == (128, 32)  # 100 padded to a multiple of 128
    assert model.position_embedding_type == "rope" and len(model.decoder.layers) == 2
    with pytest.raises(ValueError, match="vocab_size must be set"):
        GPTModelBuilder(GPTModelConfig(transformer=model_cfg.transformer)).build_model(None, True, True)
