"""Smaller names Megatron's training scripts use: startup timestamps, tensor-parallel weight shards,
the layer-wise-optimizer predicate, the multi-module backward step, the data-parallel RNG state,
flatten_state_dict, ArgumentGroupFactory and the progress log."""
import dataclasses
import typing

import pytest
import torch

from tests.fixtures.tiny_gpt import tiny_config


def test_set_startup_timestamps_moves_the_start():
    import megatron.training.training as training
    from megatron.training import set_startup_timestamps
    before = (training._TRAIN_START_TIME, dict(training._STARTUP_TIMESTAMPS))
    try:
        set_startup_timestamps(program_start=123.0, main_entry=124.0)
        assert training._TRAIN_START_TIME == 123.0 and training._STARTUP_TIMESTAMPS["main_entry"] == 124.0
    finally:
        training._TRAIN_START_TIME = before[0]
        training._STARTUP_TIMESTAMPS.update(before[1])


def _tiny_gpt_config():
    return tiny_config(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)


def test_small_training_and_core_helpers(tmp_path):
    import argparse

    from megatron.core.dist_checkpointing.strategies.torch import flatten_state_dict
    from megatron.core.model_parallel_config import resolve_tensor_parallel_weight_shards
    from megatron.core.optimizer import is_managed_by_layer_wise_optimizer
    from megatron.core.pipeline_parallel.schedules import backward_step_multimodule
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        get_data_parallel_rng_tracker_name,
        model_parallel_cuda_manual_seed,
    )
    from megatron.training.argument_utils import ArgumentGroupFactory, TypeInferenceError
    from megatron.training.utils import append_to_progress_log
    assert resolve_tensor_parallel_weight_shards(2, None, 1) == (2, 1)
    assert resolve_tensor_parallel_weight_shards(2, 8, 1) == (8, 4)
    with pytest.raises(ValueError, match="multiple"):
        resolve_tensor_parallel_weight_shards(4, 6, 1)
    emb = torch.nn.Parameter(torch.zeros(3, 2))
    emb.is_embedding_or_output_parameter = True
    assert is_managed_by_layer_wise_optimizer(torch.nn.Parameter(torch.zeros(3, 2)))
    assert not is_managed_by_layer_wise_optimizer(emb) and not is_managed_by_layer_wise_optimizer(torch.zeros(3))
    # Dict-of-modules backward: the language model's loss alone on the last stage.
    enc_in, lm_in = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)
    loss = (enc_in * 3).sum() + (lm_in * 2).sum()
    grads = backward_step_multimodule({"enc": enc_in, "lm": [lm_in]}, loss, None, _tiny_gpt_config(), "lm")
    assert torch.equal(grads["enc"], torch.full((2,), 3.0)) and torch.equal(grads["lm"], torch.full((2,), 2.0))
    model_parallel_cuda_manual_seed(5)
    with get_cuda_rng_tracker().fork(get_data_parallel_rng_tracker_name()):
        a = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(a, torch.rand(3))  # the data-parallel state is the plain seed, as in Megatron
    get_cuda_rng_tracker().reset()  # leave no seeded tracker behind for other tests
    flat, paths = flatten_state_dict({"a": {"b": 1}, "l": [{"c": 2}]})
    assert flat == {"a.b": 1, "l.0.c": 2} and paths["l.0.c"] == ("l", 0, "c")
    parser = argparse.ArgumentParser()
    ArgumentGroupFactory(_FlagsConfig, exclude=["skip"]).build_group(parser, "demo")
    args = parser.parse_args(["--num-layers", "3", "--no-use-bias", "--sizes", "4", "5", "--mode", "b"])
    assert (args.num_layers, args.use_bias, args.sizes, args.mode, args.fast) == (3, False, [4, 5], "b", False)
    assert "Layers to build." in parser.format_help() and not hasattr(args, "skip")
    with pytest.raises(TypeInferenceError):
        ArgumentGroupFactory(_BadConfig).build_group(argparse.ArgumentParser())
    append_to_progress_log(str(tmp_path), "Starting job")
    line = open(tmp_path / "progress.txt").read()
    assert line.endswith("\tStarting job\n") and "# GPUs: 1" in line


@dataclasses.dataclass
class _FlagsConfig:  # module level: ArgumentGroupFactory reads field docstrings from the source
    """Demo flags."""
    num_layers: int = 2
    """Layers to build."""
    use_bias: bool = True
    fast: bool = False
    sizes: typing.List[int] = dataclasses.field(default_factory=lambda: [1])
    mode: typing.Literal["a", "b"] = "a"
    skip: typing.Union[int, str] = 0


@dataclasses.dataclass
class _BadConfig:
    either: typing.Union[int, str] = 0


def test_set_random_seed_takes_megatrons_keywords():
    """Megatron's `_set_random_seed(seed_=..., ...)` signature: its keyword names, and its groups
    (None here: parallel_state's ranks)."""
    import inspect

    from megatron.training.initialize import _set_random_seed
    expected = ["seed_", "data_parallel_random_init", "te_rng_tracker", "inference_rng_tracker",
                "use_cudagraphable_rng", "pp_group", "dp_group", "tp_group", "ep_group", "etp_group",
                "gtp_remat_group", "egtp_remat_group"]
    assert list(inspect.signature(_set_random_seed).parameters) == expected
    _set_random_seed(seed_=1234, data_parallel_random_init=False, pp_group=None, dp_group=None, tp_group=None)
    first = torch.rand(3)
    _set_random_seed(seed_=1234)
    assert torch.equal(torch.rand(3), first)
    with pytest.raises(ValueError, match=r"--seed \(0\) must be a positive integer"):
        _set_random_seed(seed_=0)
    with pytest.raises(ValueError, match="gtp_remat_group / egtp_remat_group .* leave them None"):
        _set_random_seed(seed_=1, gtp_remat_group=object())
