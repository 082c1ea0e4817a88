"""A tiny random Hugging Face Llama, converted with import_hf_checkpoint, generates through tools/generate.py
exactly the tokens of transformers' generate(do_sample=False), at TP=1 and at TP=2 (2 gloo ranks with torchrun's
environment, forked by a CliRunner).

Both sides run fp32 on CPU; greedy choices can only differ on a near-tie of the top two logits, and the
random model's gaps (~1e-2) are orders of magnitude above the ~1e-6 difference of the two forwards.
"""
import re

import pytest
import torch

from tests.functional.cli_runner import CliRunner

PROMPTS = [[5, 17, 42], [7, 9, 11, 13, 100, 3, 250, 61], [200]]
NEW, VOCAB = 12, 256


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:  # torch and the entry points imported once; each generation forks its ranks
        yield runner


def _generate(cli, ckpt, nproc):
    prompts = [a for p in PROMPTS for a in ("--prompt", " ".join(map(str, p)))]
    results = cli.run(["tools/generate.py", "--load", ckpt, "--use-checkpoint-args", "--tensor-model-parallel-size",
                       str(nproc), "--num-tokens-to-generate", str(NEW), *prompts], nranks=nproc, timeout=300)
    assert [r.rc for r in results] == [0] * nproc, "".join(r.out[-3000:] + r.err[-3000:] for r in results)
    stdout = "".join(r.out for r in results)
    ids = re.findall(r"^--- \d+ tokens \(\w+\).*, ids (\[[\d, ]*\])$", stdout, re.M)
    assert len(ids) == len(PROMPTS), stdout[-3000:]
    return [eval(i) for i in ids]  # noqa: S307 - lists of ints printed by our own tool


def test_converted_llama_greedy_equals_transformers(cli, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron.training.checkpointing.hf import import_hf_checkpoint

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=VOCAB - 1)
    hf = LlamaForCausalLM(cfg).eval()
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    hf.save_pretrained(hf_dir)
    import_hf_checkpoint(hf_dir, ckpt, tp=1)
    expected = []
    with torch.no_grad():
        for p in PROMPTS:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    assert all(len(set(e)) > 3 for e in expected)  # real continuations, not an immediate stop
    assert _generate(cli, ckpt, 1) == expected
    assert _generate(cli, ckpt, 2) == expected
