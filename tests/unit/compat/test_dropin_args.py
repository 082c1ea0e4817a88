"""--yaml-cfg, --use-megatron-fsdp, --deterministic-mode and --use-cpu-initialization wiring (one process)."""
import os
import textwrap

import pytest
import torch

from megatron.training.arguments import ArgumentError, core_transformer_config_from_args, parse_args, validate_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --train-iters 5 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128").split()

# Megatron's layout (examples/gpt3/gpt_config.yaml), shortened.
YAML = textwrap.dedent("""\
    language_model:
      num_layers: 3
      hidden_size: 48
      num_attention_heads: 4
      layernorm_epsilon: 1.e-6
      layernorm_zero_centered_gamma: True
      add_bias_linear: False
      gated_linear_unit: False
      activation_func: swiglu
      persist_layer_norm: False
      init_method: null
      hidden_dropout: 0.0
      memory_efficient_layer_norm: False
    model_parallel:
      tensor_model_parallel_size: 1
      sequence_parallel: True
      use_cpu_initialization: null
      bf16: False
      params_dtype: null
    micro_batch_size: 4
    lr: 2.5e-4
    seq_length: ${SEQ}
    max_position_embeddings: 64
    split: '99,1,0'
    """)


def _parse(argv, world_size=1):
    env = {"WORLD_SIZE": str(world_size), "RANK": "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        args = parse_args(argv=BASE + argv)
        return validate_args(args)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _yaml(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_maps_megatron_layout(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SEQ", "64")
    args = _parse(["--yaml-cfg", _yaml(tmp_path, YAML), "--micro-batch-size", "8"])
    assert (args.num_layers, args.hidden_size, args.micro_batch_size, args.lr) == (3, 48, 4, 2.5e-4)
    assert args.seq_length == 64 and args.norm_epsilon == 1e-6 and args.apply_layernorm_1p
    assert args.swiglu and not args.add_bias_linear and args.no_persist_layer_norm and args.split == "99,1,0"
    assert args.use_cpu_initialization is False and args.hidden_dropout == 0.0
    assert "micro_batch_size = 4 replaces the command-line value 8" in capsys.readouterr().out
    config = core_transformer_config_from_args(args)
    assert config.gated_linear_unit and config.layernorm_epsilon == 1e-6 and config.memory_efficient_layer_norm is False


@pytest.mark.parametrize("text,needle", [
    ("language_model:\n  num_layer: 3\n", "unknown key 'language_model.num_layer'"),
    ("micro_batch: 3\n", "unknown key 'micro_batch'"),
    ("lr: ${NO_SUCH_VARIABLE_XYZ}\n", "environment variable NO_SUCH_VARIABLE_XYZ"),
    ("language_model:\n  activation_func: relu6\n", "language_model.activation_func: 'relu6' is not one of"),
    ("micro_batch_size: 2.5\n", "micro_batch_size: 2.5 is not a valid int"),
    ("perform_rl_step: true\n", "--perform-rl-step (perform_rl_step in"),
    ("lr: [1\n", "not valid YAML"),
])
def test_yaml_errors_name_key_and_file(tmp_path, text, needle):
    path = _yaml(tmp_path, text)
    with pytest.raises(ArgumentError) as e:
        _parse(["--yaml-cfg", path])
    assert needle in str(e.value) and path in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("strategy,dist_opt,fsdp2,reshard", [
    ("no_shard", False, False, None), ("optim", True, False, None),
    ("optim_grads", False, True, False), ("optim_grads_params", False, True, True)])
def test_megatron_fsdp_strategies(strategy, dist_opt, fsdp2, reshard):
    args = _parse(["--use-megatron-fsdp", "--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--data-parallel-sharding-strategy", strategy], world_size=2)
    assert (args.use_distributed_optimizer, args.use_torch_fsdp2) == (dist_opt, fsdp2)
    if fsdp2:
        assert args.torch_fsdp2_reshard_after_forward is reshard and not args.overlap_grad_reduce


def test_megatron_fsdp_refusals():
    with pytest.raises(ArgumentError, match="--use-megatron-fsdp and --use-torch-fsdp2 are exclusive"):
        _parse(["--use-megatron-fsdp", "--use-torch-fsdp2"], world_size=2)
    with pytest.raises(ArgumentError, match="does not support --pipeline-model-parallel-size > 1"):
        _parse(["--use-megatron-fsdp", "--pipeline-model-parallel-size", "2"], world_size=2)
    assert _parse(["--use-megatron-fsdp", "--pipeline-model-parallel-size", "2", "--data-parallel-sharding-strategy",
                   "optim"], world_size=2).use_distributed_optimizer


@pytest.fixture
def restore_determinism():
    """--deterministic-mode sets process-wide state: put it back for the tests that follow."""
    names = ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG")
    saved = {name: os.environ.pop(name, None) for name in names}
    yield
    for name, value in saved.items():
        os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False


def test_deterministic_mode_wiring(restore_determinism, capsys):
    args = _parse(["--deterministic-mode"])
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert os.environ["NCCL_ALGO"] == "Ring" and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert core_transformer_config_from_args(args).deterministic_mode
    assert "deterministic mode: torch deterministic algorithms, NCCL_ALGO=Ring" in capsys.readouterr().out


@pytest.mark.parametrize("env,argv,needle", [
    ({"NCCL_ALGO": "NVLS"}, [], "--deterministic-mode: NCCL_ALGO=NVLS may not be deterministic"),
    ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, [], "CUBLAS_WORKSPACE_CONFIG=:0:0 is not deterministic"),
    ({}, ["--torch-compile"], "--deterministic-mode with --torch-compile"),
])
def test_deterministic_mode_refusals(restore_determinism, env, argv, needle):
    os.environ.update(env)
    with pytest.raises(ArgumentError) as e:
        _parse(["--deterministic-mode"] + argv)
    assert needle in str(e.value)


def test_initialization_flags_reach_config():
    assert _parse([]).use_cpu_initialization is False
    config = core_transformer_config_from_args(_parse(["--use-cpu-initialization", "--no-initialization"]))
    assert config.use_cpu_initialization is True and config.perform_initialization is False


def test_checkpoint_strictness_and_data_sharding():
    args = _parse(["--dist-ckpt-strictness", "log_all", "--no-data-sharding"])
    assert args.dist_ckpt_strictness == "log_all" and args.data_sharding is False
    with pytest.raises(ArgumentError, match="--dist-ckpt-strictness raise_all: checks of unexpected checkpoint keys"):
        _parse(["--dist-ckpt-strictness", "raise_all"])


def test_no_data_sharding_samples_whole_dataset():
    """--no-data-sharding (cyclic loader): the DP ranks split one permutation of the whole dataset."""
    from megatron.training.datasets.data_samplers import MegatronPretrainingRandomSampler

    def epoch(rank, sharding):
        sampler = MegatronPretrainingRandomSampler(list(range(16)), 16, 0, 2, rank, 2, data_sharding=sharding)
        return [i for batch in sampler for i in batch]
    assert max(epoch(0, True)) < 8  # rank 0's own bucket: the first half
    first, second = epoch(0, False), epoch(1, False)
    assert sorted(first + second) == list(range(16)) and max(first) >= 8
