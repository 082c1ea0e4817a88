"""MoE flags: one-line errors naming the flag, --moe-layer-freq patterns, the fields that reach the
config."""
import pytest

from megatron.training.arguments import ArgumentError
from tests.unit.training.arguments.test_arguments import _args, assert_refused_in_one_line


@pytest.mark.parametrize("flags,world,message", [
    ("--num-experts 4 --moe-router-topk 5", 1, "--moe-router-topk (5)"),
    ("--num-experts 6 --expert-model-parallel-size 4", 4, "--num-experts (6) must be divisible"),
    ("--num-experts 4 --expert-model-parallel-size 4 --tensor-model-parallel-size 2", 4, "world size (4)"),
    ("--num-experts 4 --moe-layer-freq ([0]*1+[1]*3)", 1, "--moe-layer-freq pattern"),
    ("--num-experts 4 --moe-expert-capacity-factor 0", 1, "--moe-expert-capacity-factor (0.0) must be > 0"),
    ("--num-experts 4 --moe-token-dispatcher-type flex", 1, "flex needs DeepEP"),
    ("--expert-model-parallel-size 2", 2, "needs --num-experts"),
    ("--num-experts 4 --moe-apply-probs-on-input", 1, "--moe-apply-probs-on-input needs --moe-router-topk 1"),
    ("--overlap-moe-expert-parallel-comm", 1, "--overlap-moe-expert-parallel-comm is for MoE models"),
    ("--num-experts 4 --overlap-moe-expert-parallel-comm --moe-token-dispatcher-type alltoall", 1,
     "needs --expert-model-parallel-size > 1"),
    ("--num-experts 4 --expert-model-parallel-size 2 --overlap-moe-expert-parallel-comm", 2,
     "--moe-token-dispatcher-type alltoall"),
    ("--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
     "--overlap-moe-expert-parallel-comm --pipeline-model-parallel-size 2", 4, "PP (2) > 1 are not supported"),
    ("--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
     "--overlap-moe-expert-parallel-comm --tensor-model-parallel-size 2 --disable-bias-linear", 4, "TP (2)"),
    ("--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
     "--overlap-moe-expert-parallel-comm --recompute-granularity full --recompute-method uniform", 2,
     "recomputing the MoE layer"),
    ("--num-experts 4 --delay-wgrad-compute", 1, "--delay-wgrad-compute defers the grouped experts"),
    ("--num-experts 4 --use-fused-weighted-squared-relu", 1, "it needs --squared-relu (no --swiglu)"),
    ("--squared-relu --use-fused-weighted-squared-relu", 1, "--use-fused-weighted-squared-relu fuses"),
])
def test_bad_moe_flags_give_one_line(flags, world, message):
    assert_refused_in_one_line(flags, message, world_size=world)


def test_moe_layer_freq_pattern_and_flags_reach_config(capsys):
    from megatron.training.arguments import core_transformer_config_from_args
    a = _args("--num-experts 4 --moe-layer-freq ([0]*1+[1]*1) --moe-router-load-balancing-type seq_aux_loss "
              "--moe-aux-loss-coeff 1e-3 --moe-router-score-function sigmoid --moe-router-enable-expert-bias")
    c = core_transformer_config_from_args(a)
    assert c.num_moe_experts == 4 and c.moe_layer_freq == [0, 1] and c.moe_router_enable_expert_bias
    assert c.moe_router_load_balancing_type == "seq_aux_loss" and c.moe_aux_loss_coeff == 1e-3
    with pytest.raises(SystemExit):
        _args("--num-experts 4 --moe-layer-freq [x]")
    assert "argument --moe-layer-freq: '[x]': use an int or a list pattern" in capsys.readouterr().err


def test_overlap_refuses_one_hardware_queue(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ArgumentError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        _args("--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
              "--overlap-moe-expert-parallel-comm", world_size=2)


def test_overlap_flags_reach_config():
    from megatron.training.arguments import core_transformer_config_from_args
    a = _args("--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
              "--moe-grouped-gemm --disable-bias-linear --overlap-moe-expert-parallel-comm --delay-wgrad-compute",
              world_size=2)
    c = core_transformer_config_from_args(a)
    assert c.overlap_moe_expert_parallel_comm and c.delay_wgrad_compute
