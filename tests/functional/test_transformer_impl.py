"""`pretrain_gpt.py --transformer-impl transformer_engine` through the real CLI: it trains with losses equal
to `--transformer-impl local` bitwise (same layers), says the mapping once, and a torch_dist checkpoint of
the distributed optimizer (DP=2) saved under one spec resumes under the other on the same loss curve."""
import os
import re

import pytest

from megatron.core.dist_checkpointing.serialization import tensor_shapes
from tests.functional.cli_runner import CliRunner

CMD = ("pretrain_gpt.py --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
       "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --mock-data "
       "--tokenizer-type NullTokenizer --vocab-size 128 --log-interval 1 --eval-interval 100 --eval-iters 0 "
       "--num-workers 0 --train-iters 6").split()
LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.*\| lm loss: (\S+) \|")
MAPPED = ("--transformer-impl transformer_engine runs this project's fused torch layers: same functions, "
          "different kernels")


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


def _run(cli, impl, *extra, nranks=1):
    runs = cli.run(CMD + ["--transformer-impl", impl] + list(extra), nranks=nranks, timeout=120)
    for r in runs:
        assert r.rc == 0, r.out[-3000:] + r.err[-3000:]
    out = "".join(r.out for r in runs)  # rank 0 says the start-up lines, the last rank logs the losses
    return out, {int(m.group(1)): m.group(2) for m in LOSS.finditer(out)}


def test_transformer_engine_trains_like_local_bitwise(cli):
    out, te = _run(cli, "transformer_engine")
    assert out.count(MAPPED) == 1
    _, local = _run(cli, "local")
    assert sorted(te) == list(range(1, 7)) and te == local


@pytest.mark.parametrize("save_impl,load_impl", [("transformer_engine", "local"), ("local", "transformer_engine")])
def test_torch_dist_distributed_optimizer_checkpoint_crosses_specs(cli, tmp_path, save_impl, load_impl):
    d = str(tmp_path / "ckpt")
    dist = ["--use-distributed-optimizer", "--save-interval", "3"]
    _, straight = _run(cli, save_impl, "--save", d, *dist, nranks=2)
    keys = set(tensor_shapes(os.path.join(d, "iter_0000003")))
    te_key = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert (te_key in keys) == (save_impl == "transformer_engine")
    assert ("decoder.layers.0.input_layernorm.weight" in keys) == (save_impl == "local")
    _, resumed = _run(cli, load_impl, "--load", d, "--ckpt-step", "3", "--use-distributed-optimizer", nranks=2)
    assert resumed == {k: straight[k] for k in (4, 5, 6)}


def test_torch_format_checkpoint_crosses_specs(cli, tmp_path):
    d = str(tmp_path / "ckpt")
    _, straight = _run(cli, "transformer_engine", "--save", d, "--save-interval", "3", "--ckpt-format", "torch")
    _, resumed = _run(cli, "local", "--load", d, "--ckpt-step", "3", "--ckpt-format", "torch")
    assert resumed == {k: straight[k] for k in (4, 5, 6)}


def test_te_knobs_mapped_or_refused_in_one_line(cli, tmp_path):
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("qkv_fprop:\n  method: ring_exchange\n")
    out, _ = _run(cli, "transformer_engine", "--tp-comm-overlap-cfg", str(cfg), "--te-rng-tracker",
                  "--attention-backend", "fused", "--train-iters", "1")
    assert out.count(f"--tp-comm-overlap-cfg {cfg} has no effect here") == 1
    assert out.count("--te-rng-tracker has no effect here") == 1
    assert out.count("--attention-backend fused runs torch SDPA's cuDNN") == 1
    for flag, message in ((["--fp8-param-gather"], "--fp8-param-gather is not supported yet: FP8 parameters"),
                          (["--tp-comm-overlap-cfg", str(tmp_path / "none.yaml")], "no such file")):
        r = cli.run(CMD + ["--transformer-impl", "transformer_engine"] + flag, timeout=60)[0]
        assert r.rc != 0 and message in r.err, r.err[-2000:]
