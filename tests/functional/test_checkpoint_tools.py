"""tools/checkpoint: inspect a GPT checkpoint; convert torch_dist TP=1 -> torch TP=2 -> torch_dist TP=1 and
get back exactly the original weights; --saver megatron writes them stacked in Megatron-LM's layout. The six
commands fork from one CliRunner server that imported torch once."""
import os

import pytest
import torch

from tests.functional.cli_runner import CliRunner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 2 --train-iters 2 --lr 1e-2 --mock-data --tokenizer-type "
         "NullTokenizer --vocab-size 128 --eval-iters 0 --num-workers 0").split()


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


def _run(cli, *cmd):
    """``python <cmd>``; its stdout."""
    (r,) = cli.run(list(cmd), timeout=300)
    assert r.rc == 0, r.out[-3000:] + r.err[-3000:]
    return r.out


def _full_tensors(ckpt_dir):
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor
    meta = dc.load_tensors_metadata(ckpt_dir)
    sd = {k: ShardedTensor.from_rank_offsets(k, torch.empty(m.global_shape, dtype=m.dtype)) for k, m in meta.items()}
    return dc.load(sd, ckpt_dir, strict="assume_ok_unexpected"), meta


def test_inspect_and_convert_round_trip(cli, tmp_path):
    src, tp2, back = (str(tmp_path / n) for n in ("src", "tp2", "back"))
    _run(cli, os.path.join(ROOT, "pretrain_gpt.py"), *TRAIN, "--save", src, "--save-interval", "2")
    tool = os.path.join(ROOT, "tools", "checkpoint")
    out = _run(cli, os.path.join(tool, "inspect_checkpoint.py"), src)
    assert "format: torch_dist" in out and "iteration: 2" in out and "  num_layers = 2" in out
    assert "  decoder.layers.0.self_attention.linear_qkv.weight [96, 32] float32" in out
    assert "  embedding.word_embeddings.weight [128, 32] float32" in out

    _run(cli, os.path.join(tool, "convert.py"), "--load-dir", src, "--save-dir", tp2, "--target-format", "torch",
         "--target-tensor-parallel-size", "2")
    out = _run(cli, os.path.join(tool, "inspect_checkpoint.py"), tp2, "--all-args")
    assert "format: torch" in out and "  tensor_model_parallel_size = 2" in out
    assert "  mp_rank_01/model.decoder.layers.0.self_attention.linear_qkv.weight [48, 32] float32" in out

    _run(cli, os.path.join(tool, "convert.py"), "--load-dir", tp2, "--save-dir", back, "--target-format",
         "torch_dist", "--target-tensor-parallel-size", "1")
    assert open(os.path.join(back, "latest_checkpointed_iteration.txt")).read() == "2"
    (orig, meta_o), (conv, meta_c) = _full_tensors(os.path.join(src, "iter_0000002")), \
        _full_tensors(os.path.join(back, "iter_0000002"))
    model_keys = [k for k in meta_o if not k.startswith("optimizer.")]
    assert model_keys and sorted(model_keys) == sorted(meta_c)  # optimizer state is not converted
    for k in model_keys:
        assert torch.equal(orig[k], conv[k]), k
    assert conv["args"].tensor_model_parallel_size == 1 and conv["iteration"] == 2

    mlayout = str(tmp_path / "megatron")
    out = _run(cli, os.path.join(tool, "convert.py"), "--loader", "core", "--saver", "megatron", "--load-dir", back,
               "--save-dir", mlayout)
    assert "in Megatron-LM's layout" in out
    stacked, meta_m = _full_tensors(os.path.join(mlayout, "iter_0000002"))
    qkv = "decoder.layers.self_attention.linear_qkv.weight"  # Megatron's [L, 3h, h]
    assert meta_m[qkv].global_shape == (2, 96, 32) and "decoder.layers.0.self_attention.linear_qkv.weight" not in meta_m
    for layer in range(2):
        assert torch.equal(stacked[qkv][layer], orig[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"])
