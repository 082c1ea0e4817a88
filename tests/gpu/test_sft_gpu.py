"""--sft throughput on one GPU: a Llama-3-8B-shaped model cut to 8 layers (the 8B layer shape, vocab 128256,
bf16) trains on packed 4k sequences of mixed-length conversations at >= 90% of the tokens/s of pretraining
the same model on mock data of the same sequence length. Both runs go through pretrain_gpt.py; tokens/s is
global batch x --seq-length over the median steady-state "elapsed time per iteration". Skipped without CUDA.

    python -m pytest -q -s tests/gpu/test_sft_gpu.py      # prints both rates and the ratio
"""
import json
import os
import random
import re
import statistics
import subprocess
import sys

import pytest
import torch

from tests.gpu.benchmark_runs import failure_text

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, GBS, ITERS, WARMUP, VOCAB = 4096, 8, 14, 4, 128256
MODEL = ("--num-layers 8 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
         "--group-query-attention --num-query-groups 8 --kv-channels 128 --max-position-embeddings 8192 "
         "--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-5 "
         "--swiglu --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 "
         "--hidden-dropout 0.0 --bf16 --cross-entropy-loss-fusion --use-distributed-optimizer").split()


def _tokenizer(path):
    """Byte-level tokenizer padded with dummy tokens to Llama 3's vocab size (the output layer's cost)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.fixtures.tiny_chat_tokenizer import CHAT_TEMPLATE, SPECIALS
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({f"<dummy_{i}>": i for i in range(len(vocab), VOCAB - len(SPECIALS))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[3],
                                   pad_token=SPECIALS[3])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def _conversations(path, n=3000):
    """Mixed lengths: about 60 to 2300 tokens (one per character), 1-3 turns."""
    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from it an be this are".split()
    with open(path, "w") as f:
        for _ in range(n):
            messages = []
            for _ in range(rng.randint(1, 3)):
                text = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
                messages += [{"role": "user", "content": text(rng.randint(5, 60))},
                             {"role": "assistant", "content": text(rng.randint(5, 150))}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def _tokens_per_s(extra):
    cmd = [sys.executable, "pretrain_gpt.py", *MODEL, "--seq-length", str(SEQ), "--micro-batch-size", "1",
           "--global-batch-size", str(GBS), "--train-iters", str(ITERS), "--lr", "1e-5", "--eval-iters", "0",
           "--log-interval", "1", "--num-workers", "2", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, failure_text(p)
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", p.stdout)][WARMUP:]
    assert len(ms) >= 5, p.stdout[-3000:]
    return GBS * SEQ / (statistics.median(ms) / 1000.0)


def test_sft_tokens_per_second_within_10_percent_of_pretraining(tmp_path):
    tok = _tokenizer(str(tmp_path / "tok"))
    data = _conversations(str(tmp_path / "chats.jsonl"))
    common = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok]
    pretrain = _tokens_per_s(common + ["--mock-data"])
    sft = _tokens_per_s(common + ["--sft", "--sft-tokenizer-prompt-format", "default", "--data-path", data,
                                  "--split", "100,0,0"])
    print(f"\npretraining {pretrain:,.0f} tokens/s, SFT (packed {SEQ}) {sft:,.0f} tokens/s: "
          f"{100 * sft / pretrain:.1f}% ({torch.cuda.get_device_name()})")
    assert sft >= 0.9 * pretrain
