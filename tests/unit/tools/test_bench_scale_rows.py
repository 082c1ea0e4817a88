"""Every row of tools/bench_scale_rows.sh (the scale issues' side-by-side rows) passes our argument validation
at its GPU count, with the profiling flags its PROFILE=1 mode adds: a row that a device call would only
refuse after minutes of start-up is caught here. Needs ../shared/megatron_reference (the flags' source)."""
import os
import subprocess

import pytest

from megatron.training.arguments import parse_args, validate_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
REFERENCE = os.path.join(os.path.dirname(ROOT), "shared", "megatron_reference")
SCRIPT = os.path.join(ROOT, "tools", "bench_scale_rows.sh")

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(REFERENCE, "configs.sh")),
                                reason="../shared/megatron_reference is not beside this checkout")


def _script(*args):
    p = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, MREF_DIR=REFERENCE))
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_every_row_passes_argument_validation(monkeypatch):
    rows = [line.split()[0] for line in _script("--list").splitlines()]
    assert {"l8_tp2", "nemo_cp2", "nemo_cp2_a2a", "mix_ep2", "l8b_tp2dp2", "fine_ep4_overlap"} <= set(rows)
    for row in rows:
        gpus, *flags = _script("--flags", row).split()
        prof = ["--profile", "--use-pytorch-profiler", "--profile-step-start", "8", "--profile-step-end", "9",
                "--profile-ranks", *map(str, range(int(gpus))), "--tensorboard-dir", "/tmp/tb"]
        for key, value in (("WORLD_SIZE", gpus), ("RANK", "0"), ("LOCAL_RANK", "0")):
            monkeypatch.setenv(key, value)
        for extra in ([], prof):
            try:
                validate_args(parse_args(argv=flags + extra))
            except (Exception, SystemExit) as e:  # argparse exits on an unknown flag
                pytest.fail(f"row {row} ({gpus} GPUs){' + profiling' if extra else ''}: {type(e).__name__}: {e}")


def test_rows_that_run_at_once_get_their_own_gpus_and_ports(tmp_path):
    """One-GPU rows run four at a time on a 4-GPU machine and two-GPU rows two at a time: each needs its own
    devices and rendezvous ports (rows that shared a port failed with EADDRINUSE), and GPUS= confines a round."""
    bin_dir, mref = tmp_path / "bin", tmp_path / "mref"
    bin_dir.mkdir()
    mref.mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/bin/bash\nif [ "$1" = -L ]; then for i in 0 1 2 3; do echo "GPU $i"; done; '
                                         'else echo "NVIDIA H200"; fi\n')
    (bin_dir / "torchrun").write_text('#!/bin/bash\necho "OURS $CUDA_VISIBLE_DEVICES $2 $4" >> "$OUT/calls.txt"; '
                                      'echo " iteration       11/      15 | moe max rank load: 1.250000E+00 |"; '
                                      'sleep 1\n')  # --nproc_per_node N --master_port P; a log line
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (mref / "configs.sh").write_text(open(os.path.join(REFERENCE, "configs.sh")).read())
    (mref / "res.py").write_text("")
    out = tmp_path / "out"
    env = dict(os.environ, MREF_DIR=str(mref), MREF="0", OUT=str(out), PATH=f"{bin_dir}:{os.environ['PATH']}")

    def calls(**extra):
        out.mkdir(exist_ok=True)
        (out / "calls.txt").write_text("")
        p = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT,
                           env=dict(env, **extra))
        assert p.returncode == 0, p.stderr
        stdout.append(p.stdout)
        return [line.split()[1:] for line in (out / "calls.txt").read_text().splitlines()]

    stdout = []

    ones = calls(ROWS="l8b_1gpu g13_1gpu mix_1gpu fine_1gpu l8_tp2 mix_ep2")
    assert sorted(d for d, n, _ in ones if n == "1") == ["0", "1", "2", "3"]
    assert sorted(d for d, n, _ in ones if n == "2") == ["0,1", "2,3"]
    assert len({port for *_, port in ones}) == len(ones) == 6
    # Each row's median busiest-EP-rank load from our log (the scaling model's moe_rank_load).
    assert "LOAD ours_mix_ep2: moe max rank load median 1.250 over 1 iterations" in stdout[-1]
    confined = calls(ROWS="l8b_1gpu mix_1gpu", GPUS="2,3", PORT="29900")
    assert sorted(d for d, *_ in confined) == ["2", "3"]
    assert all(int(port) >= 29902 for *_, port in confined) and len({p for *_, p in confined}) == 2


def test_reference_driver_gets_the_vp_stage(tmp_path):
    """Megatron Core's interleaved rows need GPTModel(vp_stage=...): the round passes it in the ignored copy of
    the reference driver, once (a second round leaves the driver as it is)."""
    mref = tmp_path / "mref"
    mref.mkdir()
    for name in ("configs.sh", "mcore_driver.py"):
        (mref / name).write_text(open(os.path.join(REFERENCE, name)).read())
    env = dict(os.environ, MREF_DIR=str(mref), OUT=str(tmp_path / "out"), ROWS="none")
    for _ in range(2):  # the wheel install after it may fail here (no wheel): only the driver is checked
        subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    text = (mref / "mcore_driver.py").read_text()
    assert text.count("vp_stage=vp_stage,") == 1
    compile(text, "mcore_driver.py", "exec")


def test_corpus_data_replaces_mock_data_for_both_systems(tmp_path):
    """DATA=corpus: the shipped corpus is preprocessed once (BERT WordPiece ids, below every config's vocabulary)
    and the configs that both systems read name it instead of --mock-data; an unknown DATA is refused."""
    corpus = tmp_path / "corpus"
    env = dict(os.environ, MREF_DIR=REFERENCE, DATA="corpus", CORPUS_DIR=str(corpus))
    p = subprocess.run(["bash", SCRIPT, "--flags", "mix_ep4"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=env)
    assert p.returncode == 0, p.stderr
    flags = p.stdout.split()
    assert "--mock-data" not in flags and flags[flags.index("--data-path") + 1] == str(corpus / "corpus_text_document")
    configs = (corpus / "mref" / "configs.sh").read_text()  # the copy side_by_side.sh sources for Megatron's side
    assert "--mock-data" not in configs and str(corpus / "corpus_text_document") in configs
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    ids = IndexedDataset(str(corpus / "corpus_text_document"))
    assert len(ids) > 1000 and max(int(ids[i].max()) for i in range(0, len(ids), 97)) < 30522
    bad = subprocess.run(["bash", SCRIPT, "--list"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env=dict(env, DATA="real"))
    assert bad.returncode == 1 and "use mock (the default) or corpus" in bad.stderr
