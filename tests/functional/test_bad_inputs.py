"""Bad configurations and bad files through the real CLI: each run exits non-zero on every rank, and the
rank that hit the problem prints one line `[rank R] Type: message` naming the flag or file; a bad input
leaves nothing half-written. Runs go through `cli_runner` (entry point forked after its imports) so the
~50 cases fit the time budget; `test_torchrun_*` and `test_plain_python_*` use the launchers themselves."""
import os
import re
import shutil
import subprocess
import sys

import numpy
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tests.functional.cli_runner import ROOT, CliRunner

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --train-iters 2 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 128 "
         "--eval-iters 0").split()
MOCK = MODEL + ["--mock-data"]
LINE = re.compile(r"^\[rank (\d+)\] (\w+): (.+)$")


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A good dataset and its broken variants, a tokenizer file, a checkpoint directory layout."""
    d = tmp_path_factory.mktemp("bad_inputs")
    good = str(d / "good")
    builder = IndexedDatasetBuilder(good + ".bin", dtype=numpy.uint16)
    rng = numpy.random.default_rng(0)
    for _ in range(40):
        builder.add_document(rng.integers(1, 127, size=24), [24])
    builder.finalize(good + ".idx")
    for name in ("trunc_bin", "trunc_idx", "bad_magic", "no_idx"):
        shutil.copy(good + ".bin", str(d / name) + ".bin")
        shutil.copy(good + ".idx", str(d / name) + ".idx")
    with open(d / "trunc_bin.bin", "r+b") as f:
        f.truncate(os.path.getsize(good + ".bin") - 10)
    with open(d / "trunc_idx.idx", "r+b") as f:
        f.truncate(60)
    with open(d / "bad_magic.idx", "r+b") as f:
        f.write(b"NOTANIDX!")
    os.remove(d / "no_idx.idx")
    (d / "empty_vocab.json").write_text("")
    (d / "a_dir").mkdir()
    (d / "a_file").write_text("x")
    ck = d / "ckpt_garbage_tracker"
    ck.mkdir()
    (ck / "latest_checkpointed_iteration.txt").write_text("twelve")
    ck = d / "ckpt_missing_iter"
    ck.mkdir()
    (ck / "latest_checkpointed_iteration.txt").write_text("20")
    return d


def _fails(results, needle, input_error=True):
    """Every rank exited non-zero (not by timeout); one `[rank R] Type: message` line names ``needle``."""
    for r, res in enumerate(results):
        assert res.rc not in (0, "timeout"), f"rank {r} rc={res.rc}\n{res.out[-2000:]}\n{res.err[-2000:]}"
    lines = [l for res in results for l in res.err.splitlines() if LINE.match(l) and needle in l]
    assert len(lines) >= 1, f"no [rank R] line naming {needle!r}:\n" + "\n".join(r.err[-1500:] for r in results)
    for res in results:
        assert len([l for l in res.err.splitlines() if LINE.match(l)]) <= 1  # one line per rank, not a cascade
        if input_error:
            assert "Traceback" not in res.err, res.err
    return lines


# (id, extra flags, text the error line must contain)
FLAG_CASES = [
    ("split-non-numeric", ["--split", "98,x"], "--split '98,x'"),
    ("split-negative", ["--split", "90,-5,15"], "--split '90,-5,15'"),
    ("split-all-zero", ["--split", "0,0,0"], "all zero"),
    ("split-four-parts", ["--split", "1,2,3,4"], "--split '1,2,3,4'"),
    ("global-batch", ["--global-batch-size", "3"], "--global-batch-size (3)"),
    ("micro-batch-zero", ["--micro-batch-size", "0"], "--micro-batch-size"),
    ("heads-divide-hidden", ["--hidden-size", "30"], "--hidden-size (30)"),
    ("positions-short", ["--max-position-embeddings", "8"], "--max-position-embeddings (8)"),
    ("fp16-and-bf16", ["--fp16", "--bf16"], "--fp16 and --bf16"),
    ("iters-and-samples", ["--train-samples", "10"], "--train-iters and --train-samples"),
    ("min-lr", ["--min-lr", "1.0"], "--min-lr (1.0)"),
    ("dropout", ["--hidden-dropout", "1.5"], "--hidden-dropout (1.5)"),
    ("unsupported-flag", ["--fp4-format", "e2m1"], "--fp4-format is not supported yet"),
    ("exit-signal", ["--exit-signal", "SIGFOO"], "--exit-signal (SIGFOO)"),
    ("manual-gc-interval", ["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval (-1)"),
    ("warmup-past-decay", ["--lr-warmup-iters", "5"], "--lr-warmup-iters: the LR warmup must end before"),
    ("straggler-count", ["--log-straggler", "--straggler-minmax-count", "0"], "--straggler-minmax-count (0)"),
    ("straggler-port", ["--straggler-ctrlr-port", "70000"], "--straggler-ctrlr-port (70000)"),
    ("timeout-after-init", ["--distributed-timeout-seconds-after-init", "0"],
     "--distributed-timeout-seconds-after-init (0)"),
    ("injection-rate", ["--error-injection-rate", "-1"], "--error-injection-rate (-1)"),
    ("injection-report-stats", ["--error-injection-rate", "2", "--rerun-mode", "report_stats"],
     "--error-injection-rate needs"),
    ("null-tokenizer-vocab", ["--vocab-size", "0"], "--vocab-size"),
    ("save-without-interval", ["--save", "{d}/never"], "--save requires --save-interval"),
    ("save-under-a-file", ["--save", "{d}/a_file/ckpt", "--save-interval", "1"], "--save: {d}/a_file is a file"),
    ("load-is-a-file", ["--load", "{d}/a_file"], "--load: {d}/a_file is a file"),
    ("load-garbage-tracker", ["--load", "{d}/ckpt_garbage_tracker"], "holds 'twelve'"),
    ("load-missing-iteration", ["--load", "{d}/ckpt_missing_iter"], "names iteration 20"),
    ("load-missing-exit", ["--load", "{d}/nowhere", "--exit-on-missing-checkpoint"], "--load: {d}/nowhere"),
    ("data-args-path", ["--data-args-path", "{d}/nowhere.txt"], "--data-args-path"),
    ("two-data-sources", ["--data-path", "{d}/good"], "only one data source"),
    ("gpt2-needs-vocab", ["--tokenizer-type", "GPT2BPETokenizer"], "requires --vocab-file"),
    ("vocab-missing", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{d}/nowhere.json",
                       "--merge-file", "{d}/a_file"], "--vocab-file: file not found: {d}/nowhere.json"),
    ("vocab-empty", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{d}/empty_vocab.json",
                     "--merge-file", "{d}/a_file"], "--vocab-file: {d}/empty_vocab.json is empty"),
    ("merge-is-dir", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{d}/a_file",
                      "--merge-file", "{d}/a_dir"], "--merge-file: {d}/a_dir is a directory"),
    ("wandb-missing", ["--wandb-project", "p"], "--wandb-project needs the wandb package"),
]

# (id, --data-path values, text the error line must contain); model flags without --mock-data
DATA_CASES = [
    ("weights-odd", ["0.5", "{d}/good", "0.5"], "--data-path: 3 values"),
    ("weight-not-number", ["0.5", "{d}/good", "x", "{d}/good"], "weight 'x'"),
    ("weight-negative", ["-1", "{d}/good", "1", "{d}/good"], "weight -1"),
    ("weights-zero", ["0", "{d}/good", "0", "{d}/good"], "every weight is zero"),
    ("weight-among-prefixes", ["{d}/good", "0.3"], "'0.3' looks like a weight"),
    ("prefix-missing", ["{d}/nowhere"], "{d}/nowhere.bin not found"),
    ("idx-missing", ["{d}/no_idx"], "{d}/no_idx.idx not found"),
    ("bin-truncated", ["{d}/trunc_bin"], "{d}/trunc_bin.bin is truncated"),
    ("idx-truncated", ["{d}/trunc_idx"], "{d}/trunc_idx.idx is truncated"),
    ("idx-bad-header", ["{d}/bad_magic"], "{d}/bad_magic.idx is not a Megatron MMIDIDX index"),
    ("weighted-truncated", ["0.7", "{d}/good", "0.3", "{d}/trunc_bin"], "{d}/trunc_bin.bin is truncated"),
]


def _fill(values, d):
    return [v.replace("{d}", str(d)) for v in values]


@pytest.mark.parametrize("case", FLAG_CASES, ids=[c[0] for c in FLAG_CASES])
def test_bad_flag(cli, files, case):
    name, extra, needle = case
    block = ["wandb"] if name == "wandb-missing" else None
    base = MODEL if "--data-args-path" in extra else MOCK
    results = cli.run(["pretrain_gpt.py"] + base + _fill(extra, files), timeout=60, block=block)
    assert results[0].rc == 2
    _fails(results, needle.replace("{d}", str(files)))
    assert not os.path.exists(files / "never") and not os.path.exists(files / "nowhere")


@pytest.mark.parametrize("case", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data_path(cli, files, case):
    name, values, needle = case
    results = cli.run(["pretrain_gpt.py"] + MODEL + ["--split", "8,1,1", "--data-path"] + _fill(values, files),
                      timeout=60)
    assert results[0].rc == 2
    _fails(results, needle.replace("{d}", str(files)))


@pytest.mark.parametrize("flag,value", [("--rerun-mode", "sometimes"), ("--error-injection-type", "cosmic_ray")])
def test_bad_choice_is_argparse_error(cli, flag, value):
    res = cli.run(["pretrain_gpt.py"] + MOCK + [flag, value], timeout=60)[0]
    assert res.rc == 2 and f"argument {flag}: invalid choice: '{value}'" in res.err


def test_two_ranks_layout_error_on_every_rank(cli):
    results = cli.run(["pretrain_gpt.py"] + MOCK + ["--tensor-model-parallel-size", "3"], nranks=2, timeout=60)
    lines = _fails(results, "world size (2) must be divisible by --tensor-model-parallel-size (3)")
    assert sorted(LINE.match(l).group(1) for l in lines) == ["0", "1"]


def test_two_ranks_package_missing_on_one_rank(cli):
    """The last rank's node lacks wandb: it prints why, the other rank stops at start-up instead of waiting."""
    results = cli.run(["pretrain_gpt.py"] + MOCK + ["--wandb-project", "p"], nranks=2, timeout=60,
                      block=[[], ["wandb"]])
    lines = _fails(results, "--wandb-project needs the wandb package")
    assert [LINE.match(l).group(1) for l in lines] == ["1"]
    assert "another rank failed at start-up" in results[0].err


def test_two_ranks_truncated_copy_on_one_node(cli, files, tmp_path):
    """Relative --data-path on two "nodes" (working directories): rank 1's copy of the .bin is truncated."""
    for rank, source in ((0, "good"), (1, "trunc_bin")):
        (tmp_path / f"node{rank}").mkdir()
        for ext in (".bin", ".idx"):
            shutil.copy(files / (source + ext), tmp_path / f"node{rank}" / ("corpus" + ext))
    results = cli.run(["pretrain_gpt.py"] + MODEL + ["--split", "8,1,1", "--data-path", "corpus"], nranks=2,
                      timeout=60, cwd=[str(tmp_path / "node0"), str(tmp_path / "node1")])
    lines = _fails(results, "corpus.bin is truncated")
    assert [LINE.match(l).group(1) for l in lines] == ["1"]


@pytest.fixture(scope="module")
def checkpoint(cli, files):
    """A real one-iteration checkpoint in the legacy `torch` format (one file per model-parallel rank)."""
    save = files / "ckpt"
    res = cli.run(["pretrain_gpt.py"] + MOCK + ["--train-iters", "1", "--save", save, "--save-interval", "1",
                                                 "--ckpt-format", "torch"], timeout=120)[0]
    assert res.rc == 0, res.err[-3000:]
    return save


def _corrupt_copy(checkpoint, dest):
    shutil.copytree(checkpoint, dest)
    model_file = dest / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    model_file.write_bytes(model_file.read_bytes()[:200])
    return model_file


def test_corrupt_checkpoint_file(cli, checkpoint, tmp_path):
    model_file = _corrupt_copy(checkpoint, tmp_path / "ckpt")
    results = cli.run(["pretrain_gpt.py"] + MOCK + ["--load", tmp_path / "ckpt", "--ckpt-format", "torch"],
                      timeout=60)
    _fails(results, str(model_file))


def test_two_ranks_corrupt_checkpoint_on_one_node(cli, checkpoint, tmp_path):
    """Start-up succeeded on both ranks; rank 1's checkpoint copy is corrupt: it reports the file and exits,
    rank 0 (waiting for it in a collective) exits too, well before the timeout."""
    shutil.copytree(checkpoint, tmp_path / "node0" / "ckpt")
    model_file = _corrupt_copy(checkpoint, tmp_path / "node1" / "ckpt")
    results = cli.run(["pretrain_gpt.py"] + MOCK + ["--load", "ckpt", "--ckpt-format", "torch"], nranks=2,
                      timeout=60, cwd=[str(tmp_path / "node0"), str(tmp_path / "node1")])
    lines = _fails(results, os.path.relpath(model_file, tmp_path / "node1"), input_error=False)
    assert LINE.match(lines[0]).group(1) == "1"


def test_failed_save_leaves_no_partial_checkpoint(cli, tmp_path):
    """A save the format cannot write fails at the first save; the staging directory is removed."""
    save = tmp_path / "ckpt"
    results = cli.run(["pretrain_gpt.py"] + MOCK + ["--train-iters", "1", "--save", save, "--save-interval", "1",
                                                     "--ckpt-format", "torch", "--use-distributed-optimizer"],
                      timeout=120)
    _fails(results, "--ckpt-format torch with --use-distributed-optimizer")
    # Only the launch record and this rank's failure note (docs/fault_tolerance.md): no checkpoint, no staging.
    assert sorted(os.listdir(save)) == ["launch_failures", "launch_record.json"]


def _preprocess(cli, tmp_path, lines, extra=()):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "out" / "corpus"
    out.parent.mkdir(exist_ok=True)
    res = cli.run(["tools/preprocess_data.py", "--input", inp, "--output-prefix", out, "--tokenizer-type",
                   "NullTokenizer", "--vocab-size", "128", "--workers", "1", *extra], timeout=60)[0]
    return res, out.parent


@pytest.mark.parametrize("lines,extra,needle", [
    ([], (), "no documents"),
    (["", "   "], (), "no documents"),
    (['{"text": "1 2 3"}', '{"text": "4 5"'], (), "in.jsonl:2: invalid JSON"),
    (['{"body": "1 2 3"}'], ("--skip-malformed",), "no documents"),
    (['{"text": "1 2 3"}', '{"text": "4 5"}'], ("--partitions", "2", "--workers", "2", "--json-keys", "body"),
     "missing or non-text key 'body'"),
], ids=["empty", "blank-lines", "malformed-line", "all-skipped", "partition-failed"])
def test_preprocess_bad_input_writes_nothing(cli, tmp_path, lines, extra, needle):
    res, out_dir = _preprocess(cli, tmp_path, lines, extra)
    assert res.rc not in (0, "timeout")
    errors = [line for line in res.err.strip().splitlines() if line.startswith("error: ")]
    assert errors and any(needle in line for line in errors), res.err  # the partition's line, then the parent's
    assert "Traceback" not in res.err
    assert os.listdir(out_dir) == []


def test_plain_python_one_line(files):
    p = subprocess.run([sys.executable, "pretrain_gpt.py"] + MODEL + ["--data-path", f"{files}/trunc_bin"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith(f"[rank 0] ArgumentError: --data-path: {files}/trunc_bin.bin")


def test_torchrun_wandb_missing_every_rank_exits(tmp_path):
    """The issue's case: --wandb-project on 2 torchrun processes without wandb: the run fails with the line
    (on each rank that got that far before the agent stopped the other) instead of a silent exit 2."""
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "0",
                        "pretrain_gpt.py"] + MOCK + ["--wandb-project", "p"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": f"{shadow.parent}:{ROOT}", "OMP_NUM_THREADS": "1"})
    assert p.returncode != 0
    lines = [l for l in p.stderr.splitlines() if LINE.match(l) and "--wandb-project needs the wandb package" in l]
    assert lines and set(LINE.match(l).group(1) for l in lines) <= {"0", "1"}, p.stderr[-3000:]
