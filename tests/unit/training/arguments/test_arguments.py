"""Flag parsing and validate_args: Megatron names/defaults, one-line errors naming the flag."""
import os
import subprocess
import sys

import pytest

from megatron.training.arguments import (
    ArgumentError,
    core_transformer_config_from_args,
    parse_args,
    print_args,
    validate_args,
)
from tests import ROOT

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --train-iters 5 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128").split()


def _args(extra="", world_size=1, monkeypatch=None):
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), "0"
    try:
        args = parse_args(argv=BASE + extra.split())
    finally:
        del os.environ["WORLD_SIZE"], os.environ["RANK"]
    return validate_args(args)


def assert_refused_in_one_line(flags: str, message: str, world_size: int = 1) -> None:
    """validate_args refuses ``flags`` with one line holding ``message``."""
    with pytest.raises(ArgumentError) as err:
        _args(flags, world_size=world_size)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_defaults_match_megatron():
    a = _args()
    assert (a.hidden_dropout, a.attention_dropout, a.weight_decay, a.clip_grad) == (0.1, 0.1, 0.01, 1.0)
    assert (a.adam_beta1, a.adam_beta2, a.adam_eps, a.init_method_std) == (0.9, 0.999, 1e-8, 0.02)
    assert (a.seed, a.log_interval, a.eval_iters, a.make_vocab_size_divisible_by) == (1234, 100, 100, 128)
    assert (a.lr_decay_style, a.optimizer, a.distributed_timeout_minutes) == ("linear", "adam", 10)
    assert (a.initial_loss_scale, a.loss_scale_window, a.hysteresis) == (2 ** 32, 1000, 2)
    assert a.global_batch_size == 2 and a.ffn_hidden_size == 256 and a.kv_channels == 16
    assert a.add_bias_linear and a.add_qkv_bias and a.num_query_groups == 4


def test_derived_values():
    a = _args("--swiglu --disable-bias-linear --group-query-attention --num-query-groups 2", world_size=4)
    assert a.ffn_hidden_size == int((4 * 64 * 2 / 3) / 64) * 64 and not a.add_bias_linear
    assert a.data_parallel_size == 4 and a.global_batch_size == 8 and a.num_query_groups == 2
    a = _args("--use-rotary-position-embeddings --bf16")
    assert a.position_embedding_type == "rope" and a.accumulate_allreduce_grads_in_fp32


@pytest.mark.parametrize("extra,world,needle", [
    ("--global-batch-size 10 --micro-batch-size 4", 2,
     "--global-batch-size (10) must be divisible by --micro-batch-size (4) x data-parallel size (2)"),
    ("--pipeline-model-parallel-size 3", 3, "--num-layers (2) must be divisible by --pipeline-model-parallel-size (3)"),
    ("--hidden-size 66", 1, "--hidden-size (66) must be divisible by --num-attention-heads (4)"),
    ("--tensor-model-parallel-size 8", 8,
     "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size"),
    ("--tensor-model-parallel-size 2", 3, "world size (3) must be divisible by --tensor-model-parallel-size (2)"),
    ("--fp16 --bf16", 1, "--fp16 and --bf16 are mutually exclusive"),
    ("--seq-length 64", 1, "--max-position-embeddings (32) must be >= --seq-length (64)"),
    ("--train-samples 100", 1, "--train-iters and --train-samples are mutually exclusive"),
    ("--min-lr 1", 1, "--min-lr (1.0) must be <= --lr (0.001)"),
    ("--save /tmp/x", 1, "--save requires --save-interval > 0"),
    ("--data-path /nonexistent/prefix", 1, "pass only one data source"),
    ("--group-query-attention --num-query-groups 3", 1, "must be divisible by --num-query-groups (3)"),
    ("--fp4-format e2m1", 1, "--fp4-format is not supported yet"),
    ("--lr-decay-samples 10", 1, "--lr-decay-samples needs a sample-based run"),
    ("--perform-rl-step", 1, "--perform-rl-step is not supported yet"),
    ("--exit-signal NOPE", 1, "--exit-signal (NOPE) is not a signal name"),
    ("--ddp-num-buckets 2 --ddp-bucket-size 1000", 1, "pass one"),
    ("--ddp-num-buckets 0", 1, "--ddp-num-buckets (0) must be > 0"),
    ("--ddp-num-buckets 2 --use-torch-fsdp2", 1, "drop it"),
    ("--step-batch-size-schedule 0:4 --rampup-batch-size 2 2 8", 1, "pass one"),
    ("--step-batch-size-schedule 0:4 --decrease-batch-size-if-needed", 1, "drop --decrease-batch-size-if-needed"),
    ("--step-batch-size-schedule 0-4", 1, "entry '0-4': expected THRESHOLD:BATCH_SIZE"),
    ("--step-batch-size-schedule 64:4", 1, "must start at threshold 0"),
    ("--step-batch-size-schedule 0:4,64:6 --micro-batch-size 4", 1, "its last batch size (6) must be divisible"),
    ("--eval-global-batch-size 6 --eval-micro-batch-size 4", 1,
     "--eval-global-batch-size (6) must be divisible by --eval-micro-batch-size (4) x data-parallel size (1)"),
    ("--eval-micro-batch-size 0", 1, "must be > 0"),
    ("--linear-attention-freq 2", 1, "add --experimental-attention-variant gated_delta_net"),
    ("--experimental-attention-variant dsa --linear-attention-freq 2", 1,
     "--experimental-attention-variant dsa is not supported yet"),
    ("--experimental-attention-variant gated_delta_net", 1, "needs --linear-attention-freq"),
    ("--experimental-attention-variant gated_delta_net --linear-attention-freq [1,0,1]", 1,
     "must list one 1 (linear attention) or 0"),
    ("--experimental-attention-variant gated_delta_net --linear-attention-freq 2 --tensor-model-parallel-size 2 "
     "--linear-num-key-heads 3", 2, "--linear-num-key-heads"),
    ("--num-experts 4 --moe-latent-size 0", 1, "--moe-latent-size (0) must be >= 1"),
    ("--num-experts 4 --moe-latent-size 16 --moe-token-dispatcher-type alltoall --expert-model-parallel-size 2 "
     "--overlap-moe-expert-parallel-comm", 2, "--moe-latent-size with --overlap-moe-expert-parallel-comm"),
    ("--inference-dynamic-batching-num-cuda-graphs 0", 1, "--inference-dynamic-batching-num-cuda-graphs (0) must be"),
    ("--cpu-offloading-num-layers 2", 1, "--cpu-offloading-num-layers (2) must be between 1 and --num-layers - 1"),
    ("--cpu-offloading-num-layers 1 --recompute-activations", 1, "with activation recompute is not supported"),
    ("--cpu-offloading-num-layers 1 --torch-compile", 1, "drop --torch-compile or it"),
    ("--log-interval 10 --log-memory-interval 15", 1, "--log-memory-interval (15) must be a positive multiple"),
    ("--num-distributed-optimizer-instances 2", 2, "add --use-distributed-optimizer"),
    ("--num-distributed-optimizer-instances 2 --use-distributed-optimizer --cuda-graph-impl full_iteration", 2,
     "drop --num-distributed-optimizer-instances"),
    ("--num-distributed-optimizer-instances 0", 1, "--num-distributed-optimizer-instances (0) must be >= 1"),
    ("--num-distributed-optimizer-instances 3 --use-distributed-optimizer", 2,
     "must divide the data-parallel x context-parallel size (2)"),
    ("--num-distributed-optimizer-instances 2 --use-distributed-optimizer --num-experts 4 "
     "--expert-model-parallel-size 2", 2, "must divide the expert data-parallel size (1)"),
    ("--glu-linear-offset 1.0", 1, "need --swiglu or --quick-geglu"),
    ("--swiglu --quick-geglu", 1, "mutually exclusive"),
    ("--quick-geglu --activation-func-clamp-value -1", 1, "must be > 0"),
    ("--window-attn-skip-freq 2", 1, "needs --window-size"),
    ("--softmax-type learnable --context-parallel-size 2", 2, "not supported with --context-parallel-size > 1"),
    ("--microbatch-group-size-per-virtual-pipeline-stage 4", 1, "it needs virtual pipeline stages"),
    ("--inference-dynamic-batching-max-requests 0", 1, "--inference-dynamic-batching-max-requests (0) must be >= 1"),
    ("--inference-dynamic-batching-max-tokens 0", 1, "--inference-dynamic-batching-max-tokens (0) must be >= 1"),
    ("--inference-dynamic-batching-buffer-size-gb 0", 1,
     "--inference-dynamic-batching-buffer-size-gb (0.0) must be > 0"),
    ("--inference-logging-step-interval -1", 1, "--inference-logging-step-interval (-1) must be >= 0"),
    ("--inference-dynamic-batching-prefix-caching --inference-dynamic-batching-block-size 0", 1,
     "--inference-dynamic-batching-block-size (0) must be >= 1"),
    ("--inference-dynamic-batching-prefix-caching --inference-dynamic-batching-prefix-caching-coordinator-policy "
     "longest_prefix", 1, "there is no multi-engine coordinator here"),
    ("--inference-dynamic-batching-prefix-caching-routing-alpha 0.9", 1, "there is no multi-engine coordinator"),
    ("--inference-dynamic-batching-prefix-caching --inference-dynamic-batching-prefix-caching-mamba-gb 2", 1,
     "Mamba state snapshots for prefix caching are not built"),
    ("--num-layers 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--microbatch-group-size-per-virtual-pipeline-stage 1", 2, "must be at least --pipeline-model-parallel-size (2)"),
    ("--num-experts 4 --moe-layer-recompute --recompute-granularity full --recompute-method uniform "
     "--recompute-num-layers 1", 1, "drop --recompute-granularity full"),
    ("--softmax-type off-by-one --reset-attention-mask", 1, "not supported with packed sequences"),
    ("--spec megatron.core.models.gpt.gpt_layer_specs", 1, "--spec takes a module and a name"),
    ("--exp-avg-dtype bf16", 1, "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    ("--multiple-validation-sets", 1, "--multiple-validation-sets evaluates each set whole: add --full-validation"),
    ("--multiple-validation-sets --full-validation", 1, "pass the sets as --valid-data-path"),
    ("--validation-set-names a b", 1, "--validation-set-names requires --multiple-validation-sets"),
    ("--no-rope-freq 3", 1, "--no-rope-freq 3: the layer count (2) must be a multiple of it"),
    ("--no-rope-freq 2 --position-embedding-type learned_absolute", 1, "it needs --position-embedding-type rope"),
    ("--iterations-to-skip 0 3", 1, "--iterations-to-skip counts iterations from 1"),
    ("--train-sync-interval 0", 1, "--train-sync-interval must be >= 1"),
    ("--mup-base-hidden-size 32", 1, "--mup-base-hidden-size applies with --use-mup only"),
    ("--use-mup --mup-width-mult 2", 1, "--mup-width-mult is computed as --hidden-size / --mup-base-hidden-size"),
    ("--chat-template x", 1, "--chat-template renders --sft conversations: add --sft"),
    ("--mtp-use-repeated-layer", 1, "--mtp-use-repeated-layer repeats the MTP layer over --mtp-num-layers depths"),
    ("--use-precision-aware-optimizer", 1, "needs --use-distributed-optimizer"),
    ("--use-precision-aware-optimizer --use-distributed-optimizer --exp-avg-sq-dtype fp16", 1,
     "--exp-avg-sq-dtype fp16 is not supported: use fp32, bf16 (fp16 and fp8 moments need a scale per tensor"),
    ("--use-precision-aware-optimizer --use-distributed-optimizer --exp-avg-dtype fp8", 1,
     "--exp-avg-dtype fp8 is not supported"),
    ("--use-precision-aware-optimizer --use-distributed-optimizer --main-params-dtype fp16", 1,
     "--main-params-dtype fp16 keeps master copies of 16-bit params: pass --bf16 or --fp16"),
    ("--bf16 --use-precision-aware-optimizer --use-distributed-optimizer --main-grads-dtype bf16 "
     "--accumulate-allreduce-grads-in-fp32", 1, "drop --accumulate-allreduce-grads-in-fp32"),
    ("--use-precision-aware-optimizer --use-distributed-optimizer --optimizer sgd", 1,
     "works with --optimizer adam, not sgd"),
    ("--spec megatron.core.models.no_such_module layer_spec", 1, "no_such_module cannot be imported"),
    ("--spec megatron.core.models.gpt.gpt_layer_specs no_such_spec", 1, "has no attribute no_such_spec"),
    ("--spec megatron.core.models.gpt.gpt_layer_specs get_gpt_layer_local_spec", 1, "is a function, not a ModuleSpec"),
    ("--test-mode --use-torch-fsdp2", 2, "--test-mode compares whole parameters across data-parallel ranks, which "
                                         "FSDP shards"),
    ("--test-mode --use-megatron-fsdp", 2, "drop --test-mode, or FSDP"),
    ("--fim-data --fim-rate 1.5", 1, "--fim-rate (1.5) must be a probability in [0, 1]"),
    ("--fim-data --fim-spm-rate -0.1", 1, "--fim-spm-rate (-0.1) must be a probability in [0, 1]"),
    ("--fim-data --fim-split-sample <sep> --fim-fragment-rate 2", 1, "--fim-fragment-rate (2.0) must be a probability"),
    ("--fim-data --fim-split-sample <sep>", 1, "pass --fim-fragment-rate too"),
    ("--fim-rate 0.2", 1, "--fim-rate applies with --fim-data only"),
    ("--fim-data", 1, "--fim-data rewrites the text of --data-path documents; --mock-data has no text"),
    ("--defer-embedding-wgrad-compute", 1, "it needs --pipeline-model-parallel-size > 1"),
    ("--defer-embedding-wgrad-compute --pipeline-model-parallel-size 2 --no-gradient-accumulation-fusion", 2,
     "drop --no-gradient-accumulation-fusion"),
    ("--wgrad-deferral-limit -1", 1, "--wgrad-deferral-limit must be >= 0"),
    ("--wgrad-deferral-limit 2", 1, "--wgrad-deferral-limit 2 bounds the GEMMs --defer-embedding-wgrad-compute "
                                    "parks: add that flag"),
    ("--defer-embedding-wgrad-compute --pipeline-model-parallel-size 2 --cuda-graph-impl full_iteration", 2,
     "with --defer-embedding-wgrad-compute: the parked output-layer GEMMs"),
])
def test_validation_errors(extra, world, needle):
    assert_refused_in_one_line(extra, needle, world_size=world)


def test_split_with_shell_quotes_kept_is_accepted():
    """Megatron's llama example expands `"--split '99,1,0'"` unquoted: the quote characters reach argparse."""
    assert _args("--split '99,1,0'").split == "99,1,0"
    assert _args('--split "9,1"').split == "9,1"
    with pytest.raises(ArgumentError, match="--split '99,x'"):
        _args("--split '99,x'")


def test_missing_data_files(tmp_path):
    argv = [a for a in BASE if a != "--mock-data"] + ["--data-path", str(tmp_path / "corpus")]
    args = parse_args(argv=argv)
    with pytest.raises(ArgumentError, match=r"--data-path: dataset file .*corpus.bin not found"):
        validate_args(args)


def test_tokenizer_needs_files():
    argv = BASE[:-4] + ["--tokenizer-type", "GPT2BPETokenizer"]
    with pytest.raises(ArgumentError, match="--tokenizer-type GPT2BPETokenizer requires --vocab-file"):
        validate_args(parse_args(argv=argv))


def test_typo_and_abbreviation_rejected():
    with pytest.raises(SystemExit):
        parse_args(argv=BASE + ["--hiden-size", "64"])
    with pytest.raises(SystemExit):
        parse_args(argv=BASE + ["--micro-batch", "2"])  # allow_abbrev=False


def test_args_defaults_only_fill_unset():
    args = parse_args(argv=BASE[:-4] + ["--vocab-size", "128", "--mock-data"])
    validate_args(args, {"tokenizer_type": "NullTokenizer"})
    assert args.tokenizer_type == "NullTokenizer"


def test_print_args_format(capsys):
    args = _args()
    capsys.readouterr()
    print_args("arguments", args)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "------------------------ arguments ------------------------"
    assert out[-1] == "-------------------- end of arguments ---------------------"
    line = next(l for l in out if l.startswith("  hidden_size "))
    assert line == "  hidden_size " + "." * (48 - len("hidden_size")) + " 64"
    body = out[1:-1]
    assert body == sorted(body, key=str.lower)


def test_entry_point_error_is_one_line_and_nonzero():
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + BASE + ["--global-batch-size", "3"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        "[rank 0] ArgumentError: --global-batch-size (3) must be divisible by --micro-batch-size (2) x "
        "data-parallel size (1)")


def test_help_renders(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv=["--help"])
    assert e.value.code == 0 and "--global-batch-size" in capsys.readouterr().out


def test_uneven_pipeline_split_flags_reach_the_config():
    from megatron.training.arguments import core_transformer_config_from_args
    a = _args("--num-layers 5 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2 "
              "--global-batch-size 4", world_size=2)
    cfg = core_transformer_config_from_args(a)
    assert (cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage) == (2, None)


@pytest.mark.parametrize("extra,needle", [
    ("--num-layers 5 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1",
     "pipeline split: the 4 layers left after the first/last stage counts do not split evenly over 3"),
    ("--num-layers 4 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 3 "
     "--decoder-last-pipeline-num-layers 3", "pipeline split: --decoder-first/last-pipeline-num-layers exceed"),
])
def test_uneven_pipeline_split_never_drops_layers(extra, needle):
    with pytest.raises(ArgumentError) as e:
        _args(extra + " --global-batch-size 8", world_size=4)
    assert needle in str(e.value)


def test_pipeline_layout_reaches_the_config_and_sets_the_virtual_stages():
    from megatron.training.arguments import core_transformer_config_from_args
    a = _args("--num-layers 6 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|t*2|t*2|tL "
              "--global-batch-size 8", world_size=2)
    assert a.virtual_pipeline_model_parallel_size == 2 and a.overlap_p2p_comm
    cfg = core_transformer_config_from_args(a)
    assert cfg.pipeline_model_parallel_layout.decoder_counts() == [[1, 2], [2, 1]]
    flat = _args("--num-layers 5 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*3|t*2L "
                 "--global-batch-size 8", world_size=2)
    assert flat.virtual_pipeline_model_parallel_size is None


@pytest.mark.parametrize("extra,needle", [
    ("--num-layers 5 --pipeline-model-parallel-layout Et*3|t*3L", "places 6 transformer layers (t); --num-layers is 5"),
    ("--num-layers 4 --pipeline-model-parallel-layout Et*2|t*2L --decoder-first-pipeline-num-layers 2",
     "--pipeline-model-parallel-layout places every layer itself"),
    ("--num-layers 4 --pipeline-model-parallel-layout Et|t|t|tL --num-virtual-stages-per-pipeline-rank 2",
     "sets the virtual stages per pipeline rank"),
    ("--num-layers 4 --pipeline-model-parallel-layout Et|t|tL", "3 stages, not a multiple"),
])
def test_pipeline_layout_errors(extra, needle):
    with pytest.raises(ArgumentError) as e:
        _args(extra + " --pipeline-model-parallel-size 2 --global-batch-size 8", world_size=2)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_interleaved_schedule_overlaps_p2p_by_default():
    vp = ("--num-layers 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
          "--global-batch-size 8")
    a = _args(vp, world_size=2)
    assert a.virtual_pipeline_model_parallel_size == 2 and a.overlap_p2p_comm and not a.overlap_p2p_comm_warmup_flush
    config = core_transformer_config_from_args(a)
    assert config.overlap_p2p_comm and not config.batch_p2p_comm
    a = _args(vp + " --overlap-p2p-communication-warmup-flush", world_size=2)
    assert core_transformer_config_from_args(a).overlap_p2p_comm_warmup_flush
    assert not _args(vp + " --no-overlap-p2p-communication", world_size=2).overlap_p2p_comm
    # Only the interleaved schedule overlaps its p2p.
    assert not _args("--num-layers 4 --pipeline-model-parallel-size 2 --global-batch-size 8",
                     world_size=2).overlap_p2p_comm


@pytest.mark.parametrize("extra,needle", [
    ("--num-layers-per-virtual-pipeline-stage 1 --no-overlap-p2p-communication",
     "drop --no-overlap-p2p-communication"),
    ("", "needs the interleaved schedule"),
    ("--num-layers-per-virtual-pipeline-stage 2", "needs more than one virtual stage"),
])
def test_warmup_flush_overlap_needs_the_overlapped_interleaved_schedule(extra, needle):
    with pytest.raises(ArgumentError) as e:
        _args("--num-layers 4 --pipeline-model-parallel-size 2 --global-batch-size 8 "
              "--overlap-p2p-communication-warmup-flush " + extra, world_size=2)
    assert needle in str(e.value)


def test_padded_vocab_size_is_used_as_given():
    """--padded-vocab-size replaces the padding to --make-vocab-size-divisible-by x TP (e.g. a checkpoint's
    128256); smaller than the tokenizer's vocabulary or not divisible by TP: one line naming the flag."""
    from megatron.training.tokenizer.tokenizer import build_tokenizer
    base = "--tokenizer-type NullTokenizer --vocab-size 100 --global-batch-size 8"
    a = _args(base)
    build_tokenizer(a)
    assert a.padded_vocab_size == 128
    a = _args(base + " --padded-vocab-size 104")
    build_tokenizer(a)
    assert a.padded_vocab_size == 104
    for bad, world in (("99", 1), ("105", 1)):
        a = _args(base + f" --padded-vocab-size {bad} --tensor-model-parallel-size {world + 1}", world_size=world + 1)
        with pytest.raises(ValueError, match=f"--padded-vocab-size {bad} must be >= the tokenizer's vocabulary"):
            build_tokenizer(a)


def test_microbatch_group_size_reaches_the_schedule_config():
    args = _args("--num-layers 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
                 "--microbatch-group-size-per-virtual-pipeline-stage 4 --global-batch-size 16", world_size=2)
    assert core_transformer_config_from_args(args).microbatch_group_size_per_vp_stage == 4


def test_modelopt_flags_of_the_gpt_oss_script_say_they_have_no_effect(capsys):
    """Megatron's gpt-oss script passes two ModelOpt flags that only ModelOpt's model builder reads: accepted,
    each with one start-up line."""
    _args("--export-force-local-attention --enable-gpt-oss")
    out = capsys.readouterr().out
    assert "--export-force-local-attention has no effect here" in out and "--enable-gpt-oss has no effect here" in out
