"""The deterministic golden run: a fixed tiny GPT trained on CPU through ``pretrain_gpt.py``, reduced to
its per-iteration losses and a SHA-256 of the final weights, so that a refactor can prove it changed no
behaviour bit for bit.

    python tools/golden_curve.py --out golden.json          # record
    python tools/golden_curve.py --check golden.json        # rerun and compare (exit 1 on any difference)

Three layouts run: one process, TP=2 x PP=2 on 4 gloo ranks, and DP=2 with the distributed optimizer and
both overlaps (the parallel code paths). The weights are
hashed from the ``torch`` checkpoint format's model state, so any change of a single bit in any parameter
changes the hash.
"""
import argparse
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkpoint pickles the run's args, whose classes live in megatron
FLAGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 12 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
         "--lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --mock-data --tokenizer-type NullTokenizer "
         "--vocab-size 512 --log-interval 1 --eval-iters 0 --seed 1234 --attention-dropout 0 --hidden-dropout 0 "
         "--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights "
         "--ckpt-format torch --save-interval 12 --deterministic-mode").split()
LAYOUTS = {"1rank": (1, []),
           "tp2pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                          "--sequence-parallel"]),
           # The torch format does not hold the distributed optimizer: this layout is compared by its losses
           # only (7 significant digits), not by a weight hash. (Its logged params norm is left out: under
           # --overlap-param-gather it varied in the last digit between runs on a loaded machine.)
           "dp2distopt": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                              "--no-save"])}
LOSS = re.compile(r"lm loss: ([0-9.E+-]+)")
PARAMS_NORM = re.compile(r"params norm: ([0-9.E+-]+)")


def run_layout(name: str, workdir: Path) -> dict:
    nproc, extra = LAYOUTS[name]
    save = workdir / name
    save_flags = [] if "--no-save" in extra else ["--save", str(save)]
    extra = [flag for flag in extra if flag != "--no-save"]
    cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), *FLAGS, *extra, *save_flags]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd[1:]]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"golden run {name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    losses = LOSS.findall(out.stdout)
    digest = hashlib.sha256()
    import torch  # lazy: a module-level torch import costs ~2 s for --help

    for path in sorted(glob.glob(str(save / "iter_*" / "*" / "*.pt"))):
        state = torch.load(path, map_location="cpu", weights_only=False).get("model")
        if state is None:  # the distributed optimizer's own file
            continue
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                digest.update(key.encode())
                digest.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    result = {"losses": losses, "weights_sha256": digest.hexdigest() if save_flags else None}
    if PARAMS_NORM.search(out.stdout):
        result["params_norms"] = PARAMS_NORM.findall(out.stdout)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the result here")
    parser.add_argument("--check", help="compare against this recorded result")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {name: run_layout(name, Path(tmp)) for name in args.layouts.split(",")}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.check:
        expected = json.loads(Path(args.check).read_text())
        diff = [name for name in result if result[name] != expected.get(name)]
        print("golden: identical" if not diff else f"golden: DIFFERENT in {diff}")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
