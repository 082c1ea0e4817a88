"""pretrain_hybrid.py / pretrain_mamba.py as a user runs them: a tiny hybrid of every layer kind trains on
mock data and its loss falls (multi-latent attention layers too); multi-token prediction depths in the pattern
('/', or Megatron's older --mtp-hybrid-override-pattern) train and log their losses; bad patterns stop the run
with one line naming the flag. Every run forks from one CliRunner server that imported torch once."""
import re
from types import SimpleNamespace

import pytest

from tests.functional.cli_runner import CliRunner

SHAPES = ("--hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
          "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --lr-warmup-iters 2 --mock-data "
          "--tokenizer-type NullTokenizer --vocab-size 512 --log-interval 1 --eval-interval 100 --eval-iters 0 "
          "--num-workers 0 --mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2 --linear-key-head-dim 16 "
          "--linear-value-head-dim 16 --linear-num-key-heads 2 --linear-num-value-heads 4 --normalization RMSNorm "
          "--swiglu --disable-bias-linear --position-embedding-type rope --log-throughput")
LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.*throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \|.*lm loss: (\S+) \|")


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


def _run(cli, script, extra, timeout=300, shapes=SHAPES.split()):
    """``python script <shapes> <extra>``; the result as subprocess.run would give it (returncode, stdout, stderr)."""
    (r,) = cli.run([script] + shapes + extra, timeout=timeout)
    return SimpleNamespace(returncode=r.rc, stdout=r.out, stderr=r.err)


def test_tiny_hybrid_trains_and_loss_falls(cli):
    p = _run(cli, "pretrain_hybrid.py", ["--hybrid-layer-pattern", "M*-G-E", "--num-experts", "4",
                                    "--moe-router-topk", "2", "--train-iters", "15"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    losses = [float(m.group(2)) for m in map(LOSS.search, p.stdout.splitlines()) if m]
    assert len(losses) == 15 and losses[-1] < 0.85 * losses[0], losses


def test_pretrain_mamba_takes_the_older_pattern_flag(cli):
    p = _run(cli, "pretrain_mamba.py", ["--hybrid-override-pattern", "M-M-", "--train-iters", "3"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert len([m for m in map(LOSS.search, p.stdout.splitlines()) if m]) == 3


MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"]


def test_multi_latent_attention_layers_train(cli):
    p = _run(cli, "pretrain_hybrid.py", ["--hybrid-layer-pattern", "M+-*-", "--train-iters", "12"] + MLA)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    losses = [float(m.group(2)) for m in map(LOSS.search, p.stdout.splitlines()) if m]
    assert len(losses) == 12 and losses[-1] < 0.9 * losses[0], losses


MTP_LOSS = re.compile(r"\| lm loss: (\S+) \| mtp_1 loss: (\S+) \| mtp_2 loss: (\S+) \|")


@pytest.mark.parametrize("flags", [
    ["--hybrid-layer-pattern", "M*-/M-/M-"],
    ["--hybrid-layer-pattern", "M*-", "--mtp-hybrid-override-pattern", "M-", "--mtp-num-layers", "2"],
], ids=["unified_pattern", "older_flag"])
def test_mtp_depths_in_the_pattern_train(cli, flags):
    p = _run(cli, "pretrain_hybrid.py", flags + ["--train-iters", "12"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [[float(x) for x in m.groups()] for m in map(MTP_LOSS.search, p.stdout.splitlines()) if m]
    assert len(rows) == 12, p.stdout[-3000:]
    assert all(rows[-1][i] < 0.95 * rows[0][i] for i in range(3)), rows  # the main and both MTP losses fall


@pytest.mark.parametrize("extra, message", [
    (["--hybrid-layer-pattern", "M*M-", "--mtp-num-layers", "2"],
     "--mtp-num-layers 2 in a hybrid model needs the MTP layers in --hybrid-layer-pattern"),
    (["--hybrid-layer-pattern", "M*M-/M-/*-"], "every MTP depth must have the same pattern"),
    (["--hybrid-layer-pattern", "M+M-"], "has multi-latent attention layers (+): pass --multi-latent-attention"),
    (["--hybrid-layer-pattern", "M*X-"], "--hybrid-layer-pattern: 'X' at position 2 is not a layer symbol"),
    (["--hybrid-layer-pattern", "M*M-", "--num-layers", "6"],
     "--hybrid-layer-pattern has 4 layers but --num-layers is 6"),
    (["--hybrid-layer-pattern", "M*M-", "--mamba-num-groups", "3"], "must be divisible by --mamba-num-groups (3)"),
])
def test_bad_patterns_fail_with_one_line(cli, extra, message):
    p = _run(cli, "pretrain_hybrid.py", extra + ["--train-iters", "1"], timeout=120)
    assert p.returncode != 0
    lines = [l for l in (p.stdout + p.stderr).splitlines() if message in l]
    assert lines, p.stdout[-2000:] + p.stderr[-2000:]


def test_sft_packs_conversations_through_mamba_and_gdn_layers(cli, tmp_path):
    """--sft packs several conversations per row: the Mamba-2 and Gated DeltaNet layers restart at each
    conversation (tests/unit/core/models/hybrid/test_hybrid_packed.py proves the equality), and training runs."""
    from tests.fixtures.tiny_chat_tokenizer import write_arithmetic_chats, write_tiny_chat_tokenizer
    write_tiny_chat_tokenizer(str(tmp_path / "tok"))
    write_arithmetic_chats(str(tmp_path / "chats.jsonl"), 60)
    flags = [f for f in SHAPES.split() if f not in ("--mock-data",)]
    flags[flags.index("NullTokenizer")] = "HuggingFaceTokenizer"
    p = _run(cli, "pretrain_hybrid.py", [
        "--hybrid-layer-pattern", "M*G-", "--tokenizer-model", str(tmp_path / "tok"), "--sft",
        "--sft-tokenizer-prompt-format", "default", "--data-path", str(tmp_path / "chats.jsonl"), "--split",
        "100,0,0", "--attention-dropout", "0", "--lr", "3e-3", "--train-iters", "10"], shapes=flags)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    losses = [float(m.group(2)) for m in map(LOSS.search, p.stdout.splitlines()) if m]
    assert len(losses) == 10 and losses[-1] < 0.9 * losses[0], losses
