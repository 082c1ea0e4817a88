"""--use-mup (Maximal Update Parameterization) against Megatron's rules at width multiplier m = 4: the config's
attention scale, logit multiplier and init stds; the model's logits are the plain model's times 1/m and its
embeddings times --mup-embedding-mult; the optimizer divides the LR and Adam's eps of the hidden matrices by m and
keeps them for embeddings, the output layer, norms and biases; pretrain_gpt.py trains with the flags."""
import math

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.config_overrides import mup_config_overrides, standard_config_overrides
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.fixtures.tiny_gpt import run_pretrain, single_rank
from tests.parallel.dist_utils import run_distributed

H, BASE, LAYERS, HEADS, STD = 64, 16, 2, 4, 0.02


def _config(**overrides):
    fields = dict(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, hidden_dropout=0.0,
                  attention_dropout=0.0, init_method_std=STD, use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **overrides})


def _std(init, shape=(512, 512)):
    w = torch.empty(shape)
    init(w)
    return w.std().item()


def test_config_follows_megatrons_rules():
    c = _config(use_mup=True, mup_base_hidden_size=BASE)
    m = H / BASE
    assert c.mup_width_mult == m and c.mup_output_mult == 1 / m
    assert c.softmax_scale == 1 / c.kv_channels  # 1/d instead of 1/sqrt(d)
    assert _config(use_mup=True, mup_base_hidden_size=BASE, mup_base_head_dim=16).softmax_scale == \
        math.sqrt(16) / c.kv_channels
    assert _config(use_mup=True, mup_base_hidden_size=BASE, softmax_scale=0.3).softmax_scale == 0.3
    for init, want in ((c.init_method, STD / math.sqrt(m)), (c.embedding_init_method, STD),
                       (c.output_layer_init_method, STD / (math.sqrt(2 * LAYERS) * math.sqrt(m)))):
        assert abs(_std(init) - want) < 0.02 * want
    with pytest.raises(ValueError, match="--mup-width-mult is computed"):
        _config(use_mup=True, mup_width_mult=2.0)


def _gpt(config, untie=True):
    torch.manual_seed(0)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=96, max_sequence_length=16,
                    share_embeddings_and_output_weights=not untie)


def test_logits_and_embeddings_are_scaled():
    single_rank()
    mup = _gpt(_config(use_mup=True, mup_base_hidden_size=BASE, mup_embedding_mult=1.0))
    plain = _gpt(_config(softmax_scale=mup.config.softmax_scale))
    plain.load_state_dict(mup.state_dict())
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12)[None].expand(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(mup(ids, pos, None), plain(ids, pos, None) * (BASE / H), rtol=1e-5, atol=1e-6)
        doubled = _gpt(_config(use_mup=True, mup_base_hidden_size=BASE, mup_embedding_mult=2.0))
        doubled.load_state_dict(mup.state_dict())
        torch.testing.assert_close(doubled.embedding(ids, pos), 2 * mup.embedding(ids, pos))
    # The untied output layer starts like the embeddings (base std), the hidden weights at std / sqrt(m).
    assert abs(mup.output_layer.weight.std().item() - STD) < 0.1 * STD
    fc1 = mup.decoder.layers[0].mlp.linear_fc1.weight
    assert abs(fc1.std().item() - STD / 2) < 0.1 * STD / 2


def test_optimizer_scales_hidden_matrices_only():
    single_rank()
    model = _gpt(_config(use_mup=True, mup_base_hidden_size=BASE))
    config = OptimizerConfig(lr=1e-3, min_lr=1e-4, adam_eps=1e-8, weight_decay=0.1)
    overrides = {**standard_config_overrides(config), **mup_config_overrides(config, H / BASE, "adam")}
    opt = get_megatron_optimizer(config, [model], config_overrides=overrides)
    names = {p: n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for main in group["params"]:
            name = names[opt.main_to_model[main]] if main in opt.main_to_model else names[main]
            hidden = main.dim() == 2 and "embedding" not in name and "output_layer" not in name
            assert group["max_lr"] == (1e-3 / 4 if hidden else 1e-3), name
            assert group["min_lr"] == (1e-4 / 4 if hidden else 1e-4), name
            assert group["eps"] == (1e-8 / 4 if hidden else 1e-8), name
            assert group["wd_mult"] == (0.0 if name.endswith(".bias") or main.dim() == 1 else 1.0), name


def _train_with_mup():
    losses, max_lrs = [], set()

    def on_step(model, optimizer, result):
        losses.append(float(result[0]["lm loss"]))
        max_lrs.update(group["max_lr"] for group in optimizer.param_groups)
    run_pretrain(("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
                  "--max-position-embeddings 16 --vocab-size 128 --tokenizer-type NullTokenizer --mock-data --lr 3e-3 "
                  "--log-interval 1 --eval-iters 0 --num-workers 0 --global-batch-size 4 --micro-batch-size 2 "
                  "--train-iters 8 --use-mup --mup-base-hidden-size 16 --untie-embeddings-and-output-weights").split(),
                 on_step=on_step)
    return losses, max_lrs


def test_pretrain_gpt_trains_with_mup():
    losses, max_lrs = run_distributed(_train_with_mup, 1)[0]
    assert max_lrs == {3e-3, 3e-3 / 4}  # the hidden matrices' LR divided by the width multiplier
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
