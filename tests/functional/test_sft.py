"""Hugging Face -> SFT -> Hugging Face -> generate, through the real entry points (examples/sft's path).

A tiny random Llama with a chat-template tokenizer is imported (tools/checkpoint/hf.py), fine-tuned with
`pretrain_gpt.py --sft --pretrained-checkpoint` for a few steps, resumed mid-epoch from its checkpoint
(the resumed iterations reproduce the uninterrupted run's losses), exported back, loaded by transformers
(its logits equal ours, fp32, 1e-5 relative) and used to generate: tools/generate.py on our checkpoint
gives the tokens of transformers' greedy generate() on the export.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from tests.fixtures.tiny_chat_tokenizer import write_arithmetic_chats, write_tiny_chat_tokenizer  # noqa: E402
from tests.functional.cli_runner import CliRunner  # noqa: E402
from tests.parallel.dist_utils import run_distributed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB, SEQ = 260, 128
RTOL = 1e-5  # fp32 on CPU, same operations as transformers: only summation order differs (~3e-7)


def _run(*cmd, cli=None):
    """``python <cmd>`` (forked from ``cli``, a CliRunner, when given); its stdout."""
    if cli is not None:
        (r,) = cli.run(list(cmd), timeout=300)
        assert r.rc == 0, r.out[-3000:] + r.err[-3000:]
        return r.out
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable] + list(cmd), capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _losses(log):
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)", log)}


def _sft(cli, ckpt, save, iters, extra=()):
    return _run("pretrain_gpt.py", "--pretrained-checkpoint", ckpt, "--load", save, "--save", save,
                "--use-checkpoint-args", "--tokenizer-model", ckpt, "--sft", "--sft-tokenizer-prompt-format",
                "default", "--data-path", os.path.join(os.path.dirname(ckpt), "chats.jsonl"), "--split", "100,0,0",
                "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters",
                str(iters), "--lr", "3e-3", "--eval-iters", "0", "--num-workers", "0",
                "--save-interval", "2", "--log-interval", "1", "--attention-dropout", "0", *extra, cli=cli)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("sft_e2e")
    hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=256, eos_token_id=259)
    LlamaForCausalLM(cfg).save_pretrained(hf_dir)
    write_tiny_chat_tokenizer(hf_dir)
    write_arithmetic_chats(str(root / "chats.jsonl"), 40)
    full, resumed = str(root / "sft_full"), str(root / "sft_resumed")
    exported = str(root / "exported")
    with CliRunner() as cli:  # the import, three training runs and the export fork from one server
        _run("tools/checkpoint/hf.py", "import", "--hf-model-path", hf_dir, "--output-path", ckpt, cli=cli)
        full_log = _sft(cli, ckpt, full, 4)
        _sft(cli, ckpt, resumed, 4, ["--exit-interval", "2"])  # stops after 2 of 4 iterations ...
        resumed_log = _sft(cli, ckpt, resumed, 4)  # ... and resumes from iteration 2's checkpoint
        _run("tools/checkpoint/hf.py", "export", "--checkpoint-path", full, "--output-path", exported, cli=cli)
    return dict(root=root, hf=hf_dir, ckpt=ckpt, trained=full, exported=exported, full_log=full_log,
                resumed_log=resumed_log)


def test_sft_trains_and_resumes_mid_epoch(world):
    full, resumed = _losses(world["full_log"]), _losses(world["resumed_log"])
    assert sorted(full) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert "fine-tuning from --pretrained-checkpoint" in world["full_log"]
    assert "fine-tuning from --pretrained-checkpoint" not in world["resumed_log"]  # --load wins once saved
    for it in (3, 4):
        assert abs(resumed[it] - full[it]) <= 1e-5 * abs(full[it]), (it, resumed[it], full[it])
    assert full[4] < full[1]


def _our_logits(ckpt, tokenizer_dir, tokens):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.checkpointing.args import load_args_from_checkpoint
    from megatron.training.global_vars import set_args
    from megatron.training.model_setup import get_model
    from pretrain_gpt import model_provider
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    args = parse_args(argv=["--load", ckpt, "--use-checkpoint-args", "--micro-batch-size", "1", "--seq-length",
                            str(SEQ), "--lr", "0", "--train-iters", "1", "--mock-data", "--tokenizer-model",
                            tokenizer_dir, "--auto-detect-ckpt-format"])
    args.rank, args.world_size = 0, 1
    load_args_from_checkpoint(args)
    set_args(validate_args(args))
    model = get_model(model_provider, wrap_with_ddp=False)
    load_checkpoint(model, None, None)
    model[0].eval()
    with torch.no_grad():
        out = model[0](tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    ps.destroy_model_parallel()
    return out[..., :VOCAB].clone()


def test_export_loads_in_transformers_with_our_logits(world):
    from transformers import AutoModelForCausalLM
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(world["exported"], attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(tokens).logits
    ours = run_distributed(_our_logits, 1, world["trained"], world["ckpt"], tokens, timeout=300)[0]
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= RTOL
    with torch.no_grad():  # fine-tuning moved the weights away from the imported model
        base = AutoModelForCausalLM.from_pretrained(world["hf"], attn_implementation="eager").eval()(tokens).logits
    assert ((base - ref).abs().max() / ref.abs().max()).item() > 1e-3
    for name in ("tokenizer.json", "chat_template.jinja"):  # the export is servable with its chat template
        assert os.path.isfile(os.path.join(world["exported"], name)), name


def test_generate_matches_transformers_on_the_export(world):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(world["exported"])
    prompt = tok.apply_chat_template([{"role": "user", "content": "12+30?"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(world["exported"], attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=8, do_sample=False, pad_token_id=259)
    expected = out[0, len(ids):].tolist()
    log = _run("tools/generate.py", "--load", world["trained"], "--use-checkpoint-args", "--tokenizer-model",
               world["ckpt"], "--num-tokens-to-generate", "8", "--prompt", prompt)
    got = re.findall(r"^--- \d+ tokens \(\w+\).*, ids (\[[\d, ]*\])$", log, re.M)
    assert got and json.loads(got[0]) == expected
