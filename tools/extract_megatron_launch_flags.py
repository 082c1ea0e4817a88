"""Extract the training flags of Megatron-LM's example launch scripts (and of the Megatron-MoE-ModelZoo
configs) into tests/functional/data/megatron_launch_scripts.json, so the launch-script test runs offline.

Megatron's bash scripts run under bash with a fake `torchrun` first on PATH that records its argv (the
script's own array/string expansion, comments and conditionals included); the positional arguments get
placeholder paths. The ModelZoo YAML configs go through the zoo's own rule (sbatch_benchmarking.sh's yq
filter: `true` -> the bare flag, `false` -> left out), with the `${VAR}` placeholders filled from the
zoo's runtime.conf row for that model.

    python tools/extract_megatron_launch_flags.py --megatron <git dir> --model-zoo <git dir>
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "functional", "data", "megatron_launch_scripts.json")
# Each script with the positional arguments it documents (paths; the test replaces them).
MEGATRON_SCRIPTS = {
    "examples/gpt3/train_gpt3_175b_distributed.sh": ["/ckpt", "/tensorboard", "/gpt2-vocab.json", "/gpt2-merges.txt",
                                                     "/data_text_document"],
    "examples/llama/train_llama3_8b_h100_fp8.sh": [],  # its defaults: MOCK tokenizer and data
    "examples/mixtral/train_mixtral_8x7b_distributed.sh": ["/ckpt", "/tokenizer.model", "/data_text_document"],
    "examples/bert/train_bert_340m_distributed.sh": ["/ckpt", "/tensorboard", "/bert-vocab.txt",
                                                     "/data_text_document"],
    "examples/t5/train_t5_220m_distributed.sh": ["/ckpt", "/tensorboard", "/bert-large-cased-vocab.txt",
                                                 "/data_text_document"],
    "examples/mamba/train.sh": ["/data_text_document", "/tokenizer.model"],
    "examples/gptoss/02_train.sh": ["--checkpoint-path", "."],  # its defaults: MOCK tokenizer and data
    "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh": [],  # its defaults: MOCK tokenizer and data
}
# Environment a script reads to pick its launcher: `uv run` is not on the extracting machine.
SCRIPT_ENV = {"examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh": {"USE_UV": "0"}}
ZOO_CONFIGS = ["DeepSeek-V3", "Qwen3-30B-A3B", "Qwen3-235B-A22B"]  # the DeepSeek-V3 and Qwen rows of runtime.conf
# runtime.conf columns, in order (the first 13 name the ${VAR}s the YAML configs read).
RUNTIME_COLUMNS = ["TP", "PP", "EP", "CP", "VPP", "PP_FIRST", "GBS", "NUM_LAYERS", "MOE_TOKEN_DISPATCHER",
                   "MOE_GROUPED_GEMM", "NODES", "RUN_TIME", "PRETRAIN", "SEQ_LEN", "DATASET"]


def _git_show(git_dir, path):
    return subprocess.run(["git", "-C", git_dir, "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True).stdout


def _head(git_dir):
    return subprocess.run(["git", "-C", git_dir, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


def megatron_script_argv(git_dir, path, positional, env=None):
    """The argv after the entry point that Megatron's script hands torchrun: (entry point, flags)."""
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir = os.path.join(tmp, "bin")
        os.mkdir(bin_dir)
        capture = os.path.join(tmp, "argv")
        shim = os.path.join(bin_dir, "torchrun")
        with open(shim, "w") as f:
            f.write(f'#!/bin/bash\nprintf "%s\\0" "$@" > {capture}\n')
        os.chmod(shim, 0o755)
        # Scripts that launch with `python -m torch.distributed.run` (gpt-oss, Megatron-FSDP): the same record;
        # any other python call runs the real interpreter.
        python_shim = os.path.join(bin_dir, "python")
        with open(python_shim, "w") as f:
            f.write(f'#!/bin/bash\nif [ "$1" = "-m" ] && [ "$2" = "torch.distributed.run" ]; then shift 2; '
                    f'printf "%s\\0" "$@" > {capture}; exit 0; fi\nexec {sys.executable} "$@"\n')
        os.chmod(python_shim, 0o755)
        script = os.path.join(tmp, "script.sh")
        with open(script, "w") as f:
            f.write(_git_show(git_dir, path))
        open(os.path.join(tmp, "pretrain_gpt.py"), "w").close()  # the llama script checks it exists
        env = {**os.environ, **(env or {}), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        subprocess.run(["bash", script, *positional], cwd=tmp, env=env, check=True, capture_output=True)
        with open(capture) as f:
            argv = [a.replace(tmp, "$PWD") for a in f.read().split("\0")[:-1]]
    entry = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    return os.path.basename(argv[entry]), argv[entry + 1:]


def _runtime_row(git_dir, model):
    conf = _git_show(git_dir, "runtime_configs/benchmarking/runtime.conf")
    row = re.search(rf'\[{re.escape(model)}\]="([^"]*)"', conf).group(1).split()
    return dict(zip(RUNTIME_COLUMNS, row))


def zoo_config_argv(git_dir, model):
    """The flags sbatch_benchmarking.sh builds from model_configs/benchmarking/<model>.yaml's MODEL_ARGS."""
    env = {**_runtime_row(git_dir, model), "LAYERS_PER_VP": "1", "WORKSPACE": "/workspace", "DATA_PATH": "/data",
           "LOAD_PATH": "/ckpt", "OUTPUT_PATH": "/output", "WANDB_PROJECT": "moe", "MBS": "1", "COMMENT": "x"}
    text = re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), _git_show(
        git_dir, f"model_configs/benchmarking/{model}.yaml"))
    argv = []
    for flag, value in yaml.safe_load(text)["MODEL_ARGS"].items():
        value = "true" if value is True else "false" if value is False else str(value)
        if value != "false":
            argv += [flag] if value == "true" else [flag] + shlex.split(value)
    return "pretrain_gpt.py", argv


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron", required=True, help="git dir of NVIDIA/Megatron-LM")
    p.add_argument("--model-zoo", required=True, help="git dir of yanring/Megatron-MoE-ModelZoo")
    args = p.parse_args()
    scripts = []
    for path, positional in MEGATRON_SCRIPTS.items():
        entry, argv = megatron_script_argv(args.megatron, path, positional, SCRIPT_ENV.get(path))
        scripts.append(dict(source="NVIDIA/Megatron-LM", commit=_head(args.megatron), path=path, entry=entry,
                            argv=argv))
    for model in ZOO_CONFIGS:
        entry, argv = zoo_config_argv(args.model_zoo, model)
        scripts.append(dict(source="yanring/Megatron-MoE-ModelZoo", commit=_head(args.model_zoo),
                            path=f"model_configs/benchmarking/{model}.yaml", entry=entry, argv=argv))
    with open(OUT) as f:
        data = json.load(f)
    data["scripts"] = scripts
    with open(OUT, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"{len(scripts)} launch configurations -> {os.path.relpath(OUT, ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
