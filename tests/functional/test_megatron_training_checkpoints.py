"""Megatron-LM training checkpoints resume here: Megatron Core 0.19.2 (its GPTModel, DDP, distributed optimizer and
LR scheduler; CPU, gloo, fp32; tests/functional/mcore_training_side.py) trains a tiny GPT 3 iterations on our mock
data, saves a training checkpoint as megatron/training/checkpointing.py does, and trains on to 6; our
``pretrain_gpt.py --load`` of that checkpoint continues with the same losses at iterations 4-6. Iteration 4 needs the
weights, 5 and 6 also the Adam moments, step, LR schedule and consumed samples.

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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SIDE = os.path.join(HERE, "mcore_training_side.py")
MCORE_SITE = os.environ.get("MCORE_SITE", "/tmp/mcore_site")
FLAGS_TSV = os.path.join(ROOT, "megatron", "training", "arguments", "megatron_flags_0.19.2.tsv")

pytestmark = pytest.mark.skipif(
    not os.path.isdir(os.path.join(MCORE_SITE, "megatron_core-0.19.2.dist-info")),
    reason=f"Megatron Core 0.19.2 is not unpacked at MCORE_SITE={MCORE_SITE}; run scripts/fetch_megatron_core.sh")

SAVE_AT, ITERS, GBS, MBS, SEQ = 3, 6, 4, 2, 16  # SEQ: mcore_checkpoint_side.SEQ
ARGV = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ} --max-position-embeddings {SEQ} "
        f"--micro-batch-size {MBS} --global-batch-size {GBS} --lr 1e-3 --min-lr 0 --lr-warmup-iters 2 --mock-data "
        f"--tokenizer-type NullTokenizer --vocab-size 128 --log-interval 1 --eval-iters 0 --eval-interval 100 "
        f"--num-workers 0 --hidden-dropout 0 --attention-dropout 0 --train-iters {ITERS} "
        f"--transformer-impl local").split()
LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.*\| lm loss: (\S+) \|")
# fp32 on CPU, the same operations in both frameworks; the log prints 7 significant digits.
RTOL = 2e-6


def _batches(path: str, distributed_optimizer: bool) -> int:
    """Write the training samples our run reads (mock data, one row per sample); return the padded vocab."""
    saved_argv = sys.argv
    sys.argv = ["pretrain_gpt.py"] + ARGV + (["--use-distributed-optimizer"] if distributed_optimizer else [])
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
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    torch.save({k: torch.stack([train[i][k] for i in range(ITERS * GBS)]) for k in keys}, path)
    return args.padded_vocab_size


def megatron_train(tmp_path, tp: int, distributed_optimizer: bool, sharding_type: str = "fully_reshardable"):
    """Megatron trains and saves at SAVE_AT under tmp_path/mcore; its {iteration: lm loss} for 1..ITERS."""
    batches = str(tmp_path / "batches.pt")
    vocab = _batches(batches, distributed_optimizer)
    job = {"tp": tp, "save_at": SAVE_AT, "ckpt_dir": str(tmp_path / "mcore"), "out": str(tmp_path / "mcore.json"),
           "batches": batches, "flags_tsv": FLAGS_TSV, "distributed_optimizer": distributed_optimizer,
           "sharding_type": sharding_type,
           "model": {"vocab_size": vocab, "config": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4},
                     "model": {"share_embeddings_and_output_weights": True}, "seed": 5},
           "args": {"lr": 1e-3, "min_lr": 0.0, "weight_decay": 0.01, "clip_grad": 1.0, "global_batch_size": GBS,
                    "micro_batch_size": MBS, "train_iters": ITERS, "lr_warmup_iters": 2, "lr_decay_style": "linear",
                    "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 128,
                    "kv_channels": 8, "seq_length": SEQ, "max_position_embeddings": SEQ,
                    "tokenizer_type": "NullTokenizer", "vocab_size": 128, "padded_vocab_size": vocab,
                    "use_distributed_optimizer": distributed_optimizer, "transformer_impl": "local",
                    "dist_ckpt_optim_fully_reshardable": sharding_type == "fully_reshardable",
                    "hidden_dropout": 0.0, "attention_dropout": 0.0}}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=MCORE_SITE, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", SIDE, "train", json.dumps(job)], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"Megatron Core training failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with open(job["out"]) as f:
        return job["ckpt_dir"], {int(k): v for k, v in json.load(f).items()}


def ours_resume(ckpt_dir: str, *extra):
    """pretrain_gpt.py --load CKPT_DIR to ITERS; (stdout, {iteration: lm loss})."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + ARGV + ["--load", ckpt_dir] + list(extra)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout, {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(p.stdout)}


def _check(theirs, ours):
    assert sorted(ours) == list(range(SAVE_AT + 1, ITERS + 1)), ours
    for it, loss in ours.items():
        assert loss == pytest.approx(theirs[it], rel=RTOL), (it, loss, theirs[it])


def test_megatron_tp2_distributed_optimizer_resumes_here_at_tp1(tmp_path):
    """--dist-ckpt-optim-fully-reshardable state saved at TP=2 resumes at TP=1 (one Megatron run: the test stays
    under a minute; the same layout is the simpler case of the same code path)."""
    ckpt, theirs = megatron_train(tmp_path, 2, distributed_optimizer=True)
    out, ours = ours_resume(ckpt, "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable")
    assert f"loading checkpoint from {ckpt} at iteration {SAVE_AT}" in out
    assert "loading Megatron-LM's optimizer state (fully_reshardable)" in out
    assert f"consumed samples: {(SAVE_AT + 1) * GBS:>12d}" in out
    _check(theirs, ours)
