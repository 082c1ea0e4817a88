"""Megatron-LM's own example launch scripts (gpt3, llama, mixtral, bert, t5, mamba, gptoss, megatron_fsdp) and the
MoE ModelZoo's DeepSeek-V3 and Qwen configs train here on CPU (gloo) with their own flags: only sizes, paths, data
and the flags listed in data/megatron_launch_scripts.json's `cpu_substitutions` are replaced (tiny model, mock
data, 1-2 ranks).
The flags were extracted from the named Megatron commits by tools/extract_megatron_launch_flags.py."""
import json
import math
import os
import re

import pytest

from tests.functional.cli_runner import ROOT, CliRunner

DATA = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                                   "megatron_launch_scripts.json")))
LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.*?\| lm loss: (\S+) \|")
DATA_FLAGS = ("--data-path", "--tokenizer-model")
PATHS = {"--save": "ckpt", "--load": "ckpt", "--tensorboard-dir": "tensorboard", "--data-cache-path": "cache"}


def _split(argv):
    """[(flag, [values])] in order; a value is any token that does not start with `--`."""
    pairs = []
    for a in argv:
        if a.startswith("--"):
            pairs.append((a, []))
        else:
            pairs[-1][1].append(a)
    return pairs


def _gaps(script):
    return [g for g in DATA["known_gaps"] if script["path"] in g["scripts"]]


def launch_argv(script, tmp):
    """The script's argv with the test's replacements applied (sizes, paths, data, CPU substitutions)."""
    per = DATA["per_script"].get(script["path"], {})
    sizes = {**DATA["size_overrides"], **per.get("overrides", {})}
    subs = {s["flag"]: s["with"] for s in DATA["cpu_substitutions"] if script["path"] in s["scripts"]}
    subs.update({g["flag"]: [] for g in _gaps(script)})
    pairs, out = _split(script["argv"]), []
    keeps_tokenizer = per.get("keep_tokenizer", False)
    for flag, values in pairs:
        if flag in subs:
            out += subs[flag]
        elif flag in sizes and flag != "about":
            out += [] if sizes[flag] is None else [flag, sizes[flag]]
        elif flag in PATHS:
            out += [flag, os.path.join(tmp, PATHS[flag])]
        elif flag in ("--vocab-file", "--merge-file"):
            out += [flag, os.path.join(ROOT, "data", per["files"][flag])]
        elif flag in DATA_FLAGS or (flag == "--tokenizer-type" and not keeps_tokenizer):
            continue
        else:
            out += [flag, *values]
    if "--mock-data" not in out:
        out.append("--mock-data")
    if not keeps_tokenizer:
        out += ["--tokenizer-type", "NullTokenizer", "--vocab-size", DATA["size_overrides"]["--vocab-size"]]
    return [script["entry"]] + out + per.get("extra", [])


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


@pytest.mark.parametrize("script", DATA["scripts"], ids=[os.path.basename(s["path"]) for s in DATA["scripts"]])
def test_megatron_launch_script_trains_on_cpu(cli, tmp_path, script):
    per = DATA["per_script"].get(script["path"], {})
    if "known_gap" in per:
        pytest.xfail(per["known_gap"])
    argv = launch_argv(script, str(tmp_path))
    nranks = per.get("nranks", 1)
    env = {k: v.split(":")[0] for k, v in DATA["environment"].items()}
    runs = cli.run(argv, nranks=nranks, timeout=120, env=env, stop_others=True)
    text = "".join(r.out + r.err for r in runs)
    assert all(r.rc == 0 for r in runs), f"{script['path']}: {' '.join(argv)}\n" + text[-4000:]
    losses = {int(i): float(v) for i, v in LOSS.findall("".join(r.out for r in runs))}
    iters = int(argv[argv.index("--train-iters") + 1]) if "--train-iters" in argv else 3
    assert iters in losses and all(math.isfinite(x) for x in losses.values()), text[-3000:]


def _gap_checks():
    """(script, gap) once per gap flag: the first script that carries it (the refusal is the flag's, not the
    script's)."""
    seen, out = set(), []
    for s in DATA["scripts"]:
        for g in _gaps(s):
            if g["flag"] not in seen:
                seen.add(g["flag"])
                out.append((s, g))
    return out


@pytest.mark.parametrize("script,gap", _gap_checks(),
                         ids=[f"{os.path.basename(s['path'])}:{g['flag']}" for s, g in _gap_checks()])
def test_known_gap_is_still_refused_with_one_line(cli, tmp_path, script, gap):
    """A flag the launch test drops is one this project refuses: once it is built, this fails and the gap goes."""
    values = dict(_split(script["argv"]))[gap["flag"]]
    argv = launch_argv(script, str(tmp_path)) + [gap["flag"]] + ([" ".join(values)] if values else [])
    runs = cli.run(argv, timeout=60)
    last = runs[0].err.strip().splitlines()[-1]
    assert runs[0].rc != 0 and gap["flag"] in last and "not supported" in last, runs[0].err[-2000:]
