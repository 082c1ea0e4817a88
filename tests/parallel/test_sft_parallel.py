"""`--sft` through pretrain_gpt.py's providers under TP=2 (+SP), PP=2, CP=2 and DP=2 equals one process.

Packed chat conversations of mixed lengths (several per sample, per-conversation attention, position
restarts, loss on assistant tokens only), fp32, dropout 0, the same seed: a layout changes only the order
of summation, so every iteration's loss must equal the single-process loss within 1e-5 relative.
"""
import json
import random

import pytest

pytest.importorskip("transformers")

from megatron.core import parallel_state as ps  # noqa: E402
from tests.fixtures.tiny_chat_tokenizer import write_tiny_chat_tokenizer  # noqa: E402
from tests.fixtures.tiny_gpt import run_pretrain  # noqa: E402
from tests.parallel.dist_utils import run_distributed  # noqa: E402

ITERS = 4
RTOL = 1e-5  # fp32 on CPU: layouts differ only in summation order (observed ~1e-7)
# 260 ids (256 bytes + 4 specials); --make-vocab-size-divisible-by 2 pads to 260 at TP=1 and TP=2 alike, so
# every layout has the same output rows (padded rows would enter the softmax).
MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --seq-length 96 "
         "--max-position-embeddings 96 --position-embedding-type rope --normalization RMSNorm --swiglu "
         "--disable-bias-linear --make-vocab-size-divisible-by 2 --hidden-dropout 0 --attention-dropout 0 "
         f"--lr 3e-3 --train-iters {ITERS} --micro-batch-size 2 --global-batch-size 4 --eval-iters 0 "
         "--log-interval 1 --num-workers 0 --seed 1234 --split 100,0,0 --sft --sft-tokenizer-prompt-format default "
         "--tokenizer-type HuggingFaceTokenizer")
LAYOUTS = {  # flags, and the (TP, PP, CP, DP) sizes they must give on 2 ranks
    "tp2_sp": ("--tensor-model-parallel-size 2 --sequence-parallel", (2, 1, 1, 1)),
    "pp2": ("--pipeline-model-parallel-size 2", (1, 2, 1, 1)),
    "cp2": ("--context-parallel-size 2", (1, 1, 2, 1)),
    "dp2": ("", (1, 1, 1, 2)),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny chat tokenizer and 40 conversations of 35-80 tokens: 1-2 per 96-token sample, some with a
    system turn or a second exchange."""
    root = tmp_path_factory.mktemp("sft_parallel")
    tokenizer = write_tiny_chat_tokenizer(str(root / "tokenizer"))
    rng = random.Random(0)
    path = root / "chats.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            messages = [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]
            if i % 3 == 0:
                messages.insert(0, {"role": "system", "content": "add"})
            if i % 4 == 1:
                messages += [{"role": "user", "content": "x2?"}, {"role": "assistant", "content": f"{2 * (a + b)}"}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return tokenizer, str(path)


def _sizes():
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size())


def _train(tokenizer, data_path, layouts):
    """{layout: (the layout's (TP, PP, CP, DP) sizes, per-iteration 'lm loss')} for each of ``layouts``,
    run one after the other in this world."""
    out = {}
    for name in layouts:
        losses, sizes = [], []

        def record(model, optimizer, result):
            sizes.append(_sizes())
            if "lm loss" in result[0]:  # only the last pipeline stage has the loss
                losses.append(float(result[0]["lm loss"]))

        flags = LAYOUTS[name][0] if name in LAYOUTS else ""
        run_pretrain(f"{MODEL} {flags} --tokenizer-model {tokenizer} --data-path {data_path}".split(), record)
        out[name] = (sizes[0], losses)
    return out


@pytest.fixture(scope="module")
def runs(data):
    sizes, reference = run_distributed(_train, 1, *data, ["single"])[0]["single"]
    assert sizes == (1, 1, 1, 1)
    per_rank = run_distributed(_train, 2, *data, list(LAYOUTS))
    return reference, per_rank


def test_sft_trains(runs):
    reference, _ = runs
    assert len(reference) == ITERS and reference[-1] < reference[0], reference


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sft_layout_matches_single_process(runs, layout):
    reference, per_rank = runs
    assert all(rank[layout][0] == LAYOUTS[layout][1] for rank in per_rank), per_rank
    losses = [rank[layout][1] for rank in per_rank if rank[layout][1]]  # ranks of the last pipeline stage
    assert len(losses) == (1 if layout == "pp2" else 2), f"{layout}: {len(losses)} ranks reported a loss"
    for got in losses:
        assert len(got) == ITERS
        for it, (x, y) in enumerate(zip(got, reference)):
            assert abs(x - y) <= RTOL * abs(y), f"{layout} iteration {it + 1}: {x} vs {y} (single process)"
