"""Megatron-LM training checkpoints round trip: Megatron -> ours -> Megatron, losses equal at each hop.

Megatron Core 0.19.2 (its GPTModel with the local spec, DDP, distributed optimizer and LR scheduler; CPU, gloo,
fp32, 2 ranks; tests/functional/mcore_training_side.py) trains tiny GPTs (dense and MLA at TP=2, MoE at TP=1 x DP=2:
Megatron trains MoE under TP only with sequence parallelism, which its local spec's torch norms refuse) 9 iterations
on our mock
data, saving a training checkpoint at 3 as megatron/training/checkpointing.py does (the dense model also at
TP=1 x DP=2 and at TP=2 in Megatron's default dp_reshardable optimizer format). Our ``pretrain_gpt.py --load`` of it
continues to 6 (iteration 4 needs the weights, 5 and 6 also the Adam moments, step, LR schedule and consumed
samples) and saves with ``--ckpt-save-megatron-layout``; Megatron resumes from that and trains 7 to 9. Both
continuations equal Megatron's uninterrupted run. Our layouts: dense at TP=1 x PP=2 (the layer axis split by
stage), MoE with grouped experts at TP=1 and with sequential experts at TP=2, MLA at TP=1, the dp_reshardable dense
at TP=1 x DP=1 (its DP=2 buckets sliced per param) and at TP=2; Megatron reads our
PP=2 save back at TP=2 and our TP=2 MoE save at TP=1. One Megatron interpreter trains all models and one resumes
all our checkpoints.

Skipped without Megatron Core 0.19.2 unpacked at MCORE_SITE (scripts/fetch_megatron_core.sh).
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import MockGPTDataset
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
from tests.functional.cli_runner import CliRunner

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SIDE = os.path.join(HERE, "mcore_training_side.py")
MCORE_SITE = os.environ.get("MCORE_SITE", "/tmp/mcore_site")
FLAGS_TSV = os.path.join(ROOT, "megatron", "training", "arguments", "megatron_flags_0.19.2.tsv")

pytestmark = pytest.mark.skipif(
    not os.path.isdir(os.path.join(MCORE_SITE, "megatron_core-0.19.2.dist-info")),
    reason=f"Megatron Core 0.19.2 is not unpacked at MCORE_SITE={MCORE_SITE}; run scripts/fetch_megatron_core.sh")

# Megatron saves at 3; ours resumes, saves at 6 and exits; Megatron resumes to 9 (one LR schedule of 9 iterations).
SAVE_AT, OURS_TO, ITERS, GBS, MBS, SEQ, VOCAB = 3, 6, 9, 4, 2, 16, 128  # SEQ: mcore_checkpoint_side.SEQ
BASE = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ} --max-position-embeddings {SEQ} "
        f"--micro-batch-size {MBS} --global-batch-size {GBS} --lr 1e-3 --min-lr 0 --lr-warmup-iters 2 --mock-data "
        f"--tokenizer-type NullTokenizer --vocab-size {VOCAB} --log-interval 1 --eval-iters 0 --eval-interval 100 "
        f"--num-workers 0 --hidden-dropout 0 --attention-dropout 0 --train-iters {ITERS} "
        f"--transformer-impl local --make-vocab-size-divisible-by 64").split()  # 128 rows at TP=1 and TP=2
LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.*\| lm loss: (\S+) \|")
# fp32 on CPU, the same operations in both frameworks; the log prints 7 significant digits.
RTOL = 2e-6

_CORE = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
_TIED = {"share_embeddings_and_output_weights": True}  # Megatron-LM's default (no --untie-embeddings-...)
# name: (Megatron's model, its args beyond the base, our flags beyond BASE).
MODELS = {
    "dense": ({"config": dict(_CORE), "model": _TIED, "seed": 5},
              {"ffn_hidden_size": 128}, []),
    # Megatron trains MoE under TP only with sequence parallelism, which its local spec's torch norms refuse:
    # its MoE model trains at TP=1 (MEGATRON_TP).
    "moe": ({"config": {**_CORE, "num_moe_experts": 4, "moe_router_topk": 2, "ffn_hidden_size": 48,
                        "gated_linear_unit": True, "activation": "silu", "add_bias_linear": False},
             "model": _TIED, "seed": 3},
            {"ffn_hidden_size": 48, "num_experts": 4, "moe_router_topk": 2, "swiglu": True, "add_bias_linear": False},
            "--num-experts 4 --moe-router-topk 2 --ffn-hidden-size 48 --swiglu --disable-bias-linear".split()),
    # Megatron-LM's training passes --rotary-scaling-factor (default 1) into MLATransformerConfig.
    "mla": ({"config": {**_CORE, "multi_latent_attention": True, "q_lora_rank": 16, "kv_lora_rank": 8,
                        "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "add_bias_linear": False,
                        "normalization": "RMSNorm", "rotary_scaling_factor": 1.0},
             "model": {**_TIED, "position_embedding_type": "rope"}, "seed": 11},
            {"ffn_hidden_size": 128, "multi_latent_attention": True, "add_bias_linear": False},
            ("--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 4 "
             "--v-head-dim 8 --disable-bias-linear --normalization RMSNorm --position-embedding-type rope").split()),
}
# The same dense model saved in Megatron's default distributed-optimizer format (no
# --dist-ckpt-optim-fully-reshardable): flat gradient-buffer buckets, at TP=1 x DP=2 and at TP=2 (one bucket set
# per TP rank).
MODELS["dense_dp_reshardable"] = MODELS["dense_dp_reshardable_tp2"] = MODELS["dense"]
MEGATRON_TP = {"dense": 2, "moe": 1, "mla": 2, "dense_dp_reshardable": 1, "dense_dp_reshardable_tp2": 2}
SHARDING = {"dense_dp_reshardable": "dp_reshardable", "dense_dp_reshardable_tp2": "dp_reshardable"}
# case: (Megatron model, our (TP, PP), our extra flags).
CASES = {
    "dense_tp1pp2": ("dense", (1, 2), ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]),
    "moe_grouped_tp1": ("moe", (1, 1), ["--moe-grouped-gemm"]),
    "moe_sequential_tp2": ("moe", (2, 1), ["--sequence-parallel"]),
    "mla_tp1": ("mla", (1, 1), []),
    # Megatron's DP=2 buckets read at DP=1
    "dense_dp_reshardable_tp1": ("dense_dp_reshardable", (1, 1), ["--use-distributed-optimizer"]),
    "dense_dp_reshardable_tp2": ("dense_dp_reshardable_tp2", (2, 1), ["--use-distributed-optimizer"]),
}


def _batches(path: str) -> None:
    """Write the training samples our runs read (mock data, one row per sample)."""
    saved_argv = sys.argv
    sys.argv = ["pretrain_gpt.py"] + BASE
    try:
        args = parse_args()
        validate_args(args)
        global_vars.set_args(args)
        global_vars.rebuild_tokenizer(args)
        sys.path.insert(0, ROOT)
        import pretrain_gpt  # lazy: an entry script at the checkout root
        config = pretrain_gpt.core_gpt_dataset_config_from_args(args)
        train, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [ITERS * GBS, 0, 0], lambda: True, config).build()
    finally:
        sys.argv = saved_argv
        global_vars.destroy_global_vars()
    assert args.padded_vocab_size == VOCAB
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    torch.save({k: torch.stack([train[i][k] for i in range(ITERS * GBS)]) for k in keys}, path)


def _megatron_run(name, mode, ckpt_dir, out):
    model, args, _ = MODELS[name]
    sharding = SHARDING.get(name, "fully_reshardable")
    return {"mode": mode, "tp": MEGATRON_TP[name], "ckpt_dir": ckpt_dir, "out": out, "save_at": SAVE_AT,
            "distributed_optimizer": True, "sharding_type": sharding,
            "model": {"vocab_size": VOCAB, **model},
            "args": {"lr": 1e-3, "min_lr": 0.0, "weight_decay": 0.01, "clip_grad": 1.0, "global_batch_size": GBS,
                     "micro_batch_size": MBS, "train_iters": ITERS, "lr_warmup_iters": 2, "lr_decay_style": "linear",
                     "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "kv_channels": 8,
                     "seq_length": SEQ, "max_position_embeddings": SEQ, "tokenizer_type": "NullTokenizer",
                     "vocab_size": VOCAB, "padded_vocab_size": VOCAB, "make_vocab_size_divisible_by": 64,
                     "use_distributed_optimizer": True,
                     "transformer_impl": "local",
                     "dist_ckpt_optim_fully_reshardable": sharding == "fully_reshardable",
                     "hidden_dropout": 0.0, "attention_dropout": 0.0, **args}}


def megatron(tmp_path, runs):
    """Megatron Core on 2 ranks in one interpreter: each run of ``runs`` in turn; their {iteration: lm loss}."""
    job = {"ranks": 2, "tp": 2, "batches": str(tmp_path / "batches.pt"), "flags_tsv": FLAGS_TSV, "runs": runs}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=MCORE_SITE, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", SIDE, json.dumps(job)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"Megatron Core failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = []
    for run in runs:
        with open(run["out"]) as f:
            out.append({int(k): v for k, v in json.load(f).items()})
    return out


def ours(cli, case, load_dir, save_dir):
    """pretrain_gpt.py --load LOAD_DIR on TP x PP ranks, saving in Megatron's layout at OURS_TO; every rank's
    output, one log."""
    name, (tp, pp), extra = CASES[case]
    argv = ["pretrain_gpt.py"] + BASE + MODELS[name][2] + extra + [
        "--load", load_dir, "--save", save_dir, "--save-interval", str(OURS_TO), "--exit-interval", str(OURS_TO),
        "--ckpt-save-megatron-layout", "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp)]
    results = cli.run(argv, nranks=tp * pp, timeout=900)
    log = "".join(r.out + r.err for r in results)
    assert [r.rc for r in results] == [0] * (tp * pp), f"{case}:\n{log[-6000:]}"
    return log


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """{case: (Megatron's uninterrupted losses, ours 4-6, Megatron's resumed 7-9, our log)}."""
    tmp = tmp_path_factory.mktemp("megatron_round_trip")
    _batches(str(tmp / "batches.pt"))
    names = sorted({name for name, _, _ in CASES.values()})
    trained = megatron(tmp, [_megatron_run(n, "train", str(tmp / f"mcore_{n}"), str(tmp / f"mcore_{n}.json"))
                             for n in names])
    reference = dict(zip(names, trained))
    # One server imports torch and pretrain_gpt once and forks the ranks of each run.
    with CliRunner() as cli:
        logs = {case: ours(cli, case, str(tmp / f"mcore_{name}"), str(tmp / f"ours_{case}"))
                for case, (name, _, _) in CASES.items()}
    resumed = megatron(tmp, [_megatron_run(name, "resume", str(tmp / f"ours_{case}"), str(tmp / f"back_{case}.json"))
                             for case, (name, _, _) in CASES.items()])
    return {case: (reference[name], {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(logs[case])},
                   back, logs[case]) for (case, (name, _, _)), back in zip(CASES.items(), resumed)}


def _check(theirs, continued, iterations):
    assert sorted(continued) == list(iterations), continued
    for it, loss in continued.items():
        assert loss == pytest.approx(theirs[it], rel=RTOL), (it, loss, theirs[it])


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_ours_megatron_losses_match(round_trip, case):
    theirs, ours_losses, back, log = round_trip[case]
    assert f"loading Megatron-LM's optimizer state ({SHARDING.get(CASES[case][0], 'fully_reshardable')})" in log
    assert f"consumed samples: {(SAVE_AT + 1) * GBS:>12d}" in log
    _check(theirs, ours_losses, range(SAVE_AT + 1, OURS_TO + 1))  # Megatron -> ours
    _check(theirs, back, range(OURS_TO + 1, ITERS + 1))  # ours -> Megatron
