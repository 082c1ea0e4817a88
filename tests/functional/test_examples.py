"""examples/: every launch script's flags parse and validate; the tiny ones run for real.

Each script runs under bash with fake `torchrun`, `srun`, `python`, `python3` and `scontrol` first on
PATH: a launch of a `pretrain_*.py` entry point is recorded (argv, NUL-separated) instead of started,
`tools/*.py` (data preparation) is skipped, anything else runs. Scripts that take positional arguments
get placeholder paths. The recorded flags then go through the entry point's parser and `validate_args`
at the world size the launcher would give (torchrun: nproc-per-node x nnodes; srun: the #SBATCH task
count); data and tokenizer files are the user's, so file-existence checks are not part of this test.
"""
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from megatron.training.arguments import build_parser, validate_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.sh"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "examples", "**", "*.sbatch"), recursive=True))
# Scripts that launch a training entry point (benchmark suites and data preparation do not).
LAUNCH = [s for s in SCRIPTS if re.search(r"pretrain_\w+\.py", open(s).read())]

_RECORD = 'printf "%s\\0" "$(basename "$0")" "$@" > "$CAPTURE_DIR/cmd.$$.$RANDOM"'
_SHIMS = {
    "torchrun": f"{_RECORD}\n",
    "srun": f"{_RECORD}\n",
    "python": f'for a in "$@"; do case "$a" in *pretrain_*.py) {_RECORD}; exit 0;; tools/*.py) exit 0;; esac; done\n'
              f'exec "{sys.executable}" "$@"\n',
    "scontrol": 'echo node001; echo node002\n',
}


def _shim_dir(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {**_SHIMS, "python3": _SHIMS["python"]}.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _sbatch_tasks(script):
    text = open(script).read()
    nodes = re.search(r"^#SBATCH --nodes[= ](\d+)", text, re.M)
    per_node = re.search(r"^#SBATCH --ntasks-per-node[= ](\d+)", text, re.M)
    return int(nodes.group(1)) * int(per_node.group(1)) if nodes and per_node else 1


def _capture(script, tmp_path):
    """Run the script with the launcher shims; return the recorded argv lists."""
    capture = tmp_path / "capture"
    capture.mkdir()
    tasks = _sbatch_tasks(script)
    env = {**os.environ, "PATH": f"{_shim_dir(tmp_path)}:{os.environ['PATH']}", "CAPTURE_DIR": str(capture),
           "CKPT_DIR": str(tmp_path / "ckpt"), "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_NTASKS": str(tasks),
           "SLURM_SUBMIT_DIR": ROOT, "OUT": str(tmp_path / "out"), "CKPT": str(tmp_path / "ckpt2")}
    used = [int(n) for n in re.findall(r"\$\{?([1-9])\b(?!:)", open(script).read())]  # $1, ${2:-x}; not ${@:5}
    positional = [str(tmp_path / f"arg{i}") for i in range(1, max(used, default=0) + 1)]
    p = subprocess.run(["bash", script, *positional], capture_output=True, text=True, timeout=60, env=env,
                       cwd=str(tmp_path))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return [open(f).read().split("\0")[:-1] for f in sorted(capture.iterdir())], tasks


def _split(argv, slurm_tasks):
    """(entry-point path, its flags, world size) from a recorded launcher command line."""
    idx = next(i for i, a in enumerate(argv) if os.path.basename(a).startswith("pretrain_") and a.endswith(".py"))
    launcher, opts = argv[0], argv[1:idx]
    world = 1
    if launcher == "torchrun" or "torch.distributed.run" in opts:
        def opt(name, default):
            for i, a in enumerate(opts):
                if a in (f"--{name}", f"--{name.replace('-', '_')}"):
                    return int(opts[i + 1])
            return default
        world = opt("nproc-per-node", 1) * opt("nnodes", 1)
    elif launcher == "srun":
        world = slurm_tasks
    return argv[idx], argv[idx + 1:], world


def _parser_for(entry):
    """The entry point's parser: ours plus the module's own `add_*_args` / `extra_args_provider` hooks."""
    if os.path.basename(entry) == "pretrain_gpt.py":
        return build_parser()
    path = os.path.join(ROOT, os.path.basename(entry))
    spec = importlib.util.spec_from_file_location(os.path.basename(entry)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    hooks = [f for name, f in vars(module).items() if callable(f) and getattr(f, "__module__", None) == module.__name__
             and (name == "extra_args_provider" or re.fullmatch(r"add_\w+_args", name))]

    def extra(parser):
        for hook in hooks:
            parser = hook(parser)
        return parser
    return build_parser(extra)


@pytest.mark.parametrize("script", LAUNCH, ids=[os.path.relpath(s, ROOT) for s in LAUNCH])
def test_example_flags_parse_and_validate(script, tmp_path, monkeypatch, capsys):
    commands, tasks = _capture(script, tmp_path)
    assert commands, f"{script} launched no pretrain_*.py"
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(os.path, "isfile", lambda p: True)  # data/tokenizer files: see the module docstring
    monkeypatch.setattr(os.path, "exists", lambda p: True)
    # The input-file checks (data, tokenizer, --load/--save directories) are the user's files too.
    import megatron.training.arguments.validation as validation
    monkeypatch.setattr(validation, "validate_inputs", lambda args, require: None)
    for argv in commands:
        entry, flags, world = _split(argv, tasks)
        assert os.path.isfile(os.path.join(ROOT, os.path.basename(entry))), entry
        args = _parser_for(entry).parse_args(flags)  # argparse exits on an unknown flag
        if os.path.basename(entry) == "pretrain_gpt.py":  # other entry points validate their own extras first
            args.rank, args.world_size = 0, world
            validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    capsys.readouterr()


# The GPT, data and Megatron Core examples (benchmark suites and BERT/T5 scripts have their own owners).
@pytest.mark.parametrize("script", [s for s in SCRIPTS if not re.search(r"benchmark_|/bert|/t5", s)],
                         ids=lambda s: os.path.relpath(s, ROOT))
def test_example_header_says_what_and_how_long(script):
    header = []
    for line in open(script).read().splitlines()[1:]:
        if not line.startswith("#"):
            break
        header.append(line)
    text = " ".join(header)
    assert len(header) >= 2, f"{script}: header comment missing"
    assert re.search(r"\d+\s*(s|min|h|hour|hours|weeks?)\b", text), f"{script}: header gives no duration"


def test_tiny_examples_run(tmp_path):
    """Data preparation, then the tiny CPU GPT (TP=2, 2 gloo ranks) on that data: loss falls, checkpoint saved."""
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "OUTPUT_PREFIX": str(tmp_path / "data" / "corpus")}
    p = subprocess.run(["bash", os.path.join(ROOT, "examples", "data", "preprocess_data.sh")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    prefix = tmp_path / "data" / "corpus_text_document"
    assert os.path.getsize(f"{prefix}.bin") > 100_000 and os.path.isfile(f"{prefix}.idx")

    env.update(DATA_PATH=str(prefix), CKPT_DIR=str(tmp_path / "ckpt"), TRAIN_ITERS="15")
    p = subprocess.run(["bash", os.path.join(ROOT, "examples", "gpt", "train_gpt_tiny_cpu.sh")],
                       capture_output=True, text=True, timeout=240, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    losses = [float(x) for x in re.findall(r"iteration +\d+/ +15 \|.*?\| lm loss: (\S+) \|", out)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses  # iterations 1, 5, 10, 15
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "15"


def test_capture_catches_an_unknown_flag_and_a_bad_layout(tmp_path):
    """The machinery above must fail on what a broken example would contain."""
    script = tmp_path / "bad.sh"
    script.write_text("ARGS=(--num-layers 2 --tensor-model-parallel-size 3)\n"
                      "torchrun --nproc-per-node 4 --nnodes 2 pretrain_gpt.py \"${ARGS[@]}\" --no-such-flag 1\n")
    (argv,), _ = _capture(str(script), tmp_path)
    entry, flags, world = _split(argv, 1)
    assert world == 8 and flags[-2:] == ["--no-such-flag", "1"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(flags)
    args = build_parser().parse_args(flags[:-2])
    args.rank, args.world_size = 0, world
    with pytest.raises(Exception, match="tensor-model-parallel-size"):
        validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})


def _run_example(script, env, *args, timeout=240):
    p = subprocess.run(["bash", os.path.join(ROOT, "examples", *script.split("/")), *args], capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, **env,
                       "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    return out


def _losses(out):
    """{iteration: 'lm loss' field as printed} from the log lines."""
    return {int(i): v for i, v in re.findall(r"iteration +(\d+)/ +\d+ \|.*?\| lm loss: (\S+) \|", out)}


def test_tiny_llama_example_stops_resumes_and_matches_an_uninterrupted_run(tmp_path):
    """SwiGLU/GQA/RMSNorm/untied at TP=2 with the distributed optimizer: save at 5, resume to 10, every
    iteration logged (the script's own 20 iterations add nothing the comparison needs)."""
    def run(ckpt, **env):
        return _run_example("llama/train_llama_tiny_cpu.sh", {"CKPT_DIR": str(tmp_path / ckpt), "TRAIN_ITERS": "10",
                                                               **env}, "--log-interval", "1")
    first = run("a", EXIT_INTERVAL="5")
    assert "[exiting program at iteration 5]" in first and max(_losses(first)) == 5
    resumed = run("a")
    assert "successfully loaded checkpoint from" in resumed and "at iteration 5" in resumed
    straight = run("b")
    after = {i: v for i, v in _losses(straight).items() if i > 5}
    assert sorted(after) == [6, 7, 8, 9, 10] and _losses(resumed) == after  # printed to 6 digits: resume is exact
    assert float(after[10]) < float(_losses(first)[1]) - 0.8  # 6.26 -> 5.12
