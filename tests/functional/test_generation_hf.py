"""A tiny random Hugging Face Llama, converted with import_hf_checkpoint, generates through tools/generate.py
exactly the tokens of transformers' generate(do_sample=False), at TP=1 and at TP=2 (torchrun, gloo).

Both sides run fp32 on CPU; greedy choices can only differ on a near-tie of the top two logits, and the
random model's gaps (~1e-2) are orders of magnitude above the ~1e-6 difference of the two forwards.
"""
import os
import re
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[5, 17, 42], [7, 9, 11, 13, 100, 3, 250, 61], [200]]
NEW, VOCAB = 12, 256


def _generate(ckpt, nproc):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                  "--nproc-per-node", str(nproc)]
    prompts = [a for p in PROMPTS for a in ("--prompt", " ".join(map(str, p)))]
    cmd = launch + [os.path.join(ROOT, "tools", "generate.py"), "--load", ckpt, "--use-checkpoint-args",
                    "--tensor-model-parallel-size", str(nproc), "--num-tokens-to-generate", str(NEW), *prompts]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ids = re.findall(r"^--- \d+ tokens \(\w+\).*, ids (\[[\d, ]*\])$", p.stdout, re.M)
    assert len(ids) == len(PROMPTS), p.stdout[-3000:]
    return [eval(i) for i in ids]  # noqa: S307 - lists of ints printed by our own tool


def test_converted_llama_greedy_equals_transformers(tmp_path):
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
    assert _generate(ckpt, 1) == expected
    assert _generate(ckpt, 2) == expected
