"""Megatron-LM's dp_reshardable optimizer buckets sliced into per-param state (megatron_dp_reshardable.py).

The end-to-end proof (Megatron Core saves, ``pretrain_gpt.py --load`` continues with equal losses) is
tests/functional/test_megatron_training_checkpoints.py; these pin the layout rules on their own.
"""
import pytest
import torch

from megatron.core.optimizer import megatron_dp_reshardable as dp_resh
from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt


def test_params_start_at_multiples_of_64_and_buckets_restart():
    # Megatron's _compute_per_buffer_param_layout with bucket size 100: [a(70) pad b(10)] [c(5)], unpadded 138, 5.
    got = dp_resh.bucket_offsets([("a", 70), ("b", 10), ("c", 5)], [138, 5])
    assert got == {"a": (0, 0, 70), "b": (0, 128, 138), "c": (1, 0, 5)}


def test_bucket_closed_at_a_padded_start():
    # A shared embedding gets its own bucket: the previous one closes at the padded start (64, not 10).
    assert dp_resh.bucket_offsets([("a", 10), ("emb", 20)], [64, 20]) == {"a": (0, 0, 10), "emb": (1, 0, 20)}


@pytest.mark.parametrize("sizes", [[100], [10, 10], [200]])
def test_sizes_that_do_not_fit_are_one_line(sizes):
    with pytest.raises(ValueError, match="dp_reshardable buckets .*--dist-ckpt-optim-fully-reshardable"):
        dp_resh.bucket_offsets([("a", 70), ("b", 10)], sizes)


def test_megatron_order_puts_linear_proj_before_linear_qkv():
    model = tiny_gpt(tiny_config())
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for p in dp_resh.megatron_param_order(model)]
    assert sorted(order) == sorted(names.values())
    layer = [n.split("layers.0.", 1)[1] for n in order if "layers.0." in n]
    assert layer[:6] == ["input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_proj.weight",
                         "self_attention.linear_proj.bias", "self_attention.linear_qkv.weight",
                         "self_attention.linear_qkv.bias"]


def test_main_param_mismatch_is_one_line():
    weight = torch.nn.Parameter(torch.ones(3))
    dp_resh.check_main_params({"w": torch.ones(3)}, {"w": weight}, "ckpt")
    dp_resh.check_main_params({"w": torch.ones(3, dtype=torch.float32) + 1e-4}, {"w": weight.bfloat16()}, "ckpt")
    with pytest.raises(ValueError, match="does not line up .*'w'.*--no-load-optim"):
        dp_resh.check_main_params({"w": torch.zeros(3)}, {"w": weight}, "ckpt")


