"""MoE through pretrain() on CPU: every expert/tensor/pipeline/data/context layout (EP=4; EP=2 with TP=2
and SP, expert-TP=2, PP=2, CP=2, or DP alone, with the distributed optimizer or with the micro-batch
overlap and delayed expert wgrad) reproduces the
single-process loss per iteration, and torch_dist checkpoints saved at iteration 1 under EP=4 and EP=2 x TP=2 load under
EP=1 and EP=4 and continue on the same curve (iteration 3 matches only if the Adam moments loaded too)
(fp32, dropout 0, no token dropping, relative 1e-5: the layouts only reorder fp32 sums).
One 4-rank world runs all layouts in turn against single-process runs of the same router variant (CP
layouts also without the aux loss, and with sigmoid scores + expert bias + the per-sequence aux loss, whose
counts span the CP ranks; and latent MoE at EP=2 x TP=2 + SP). The clip (0.05) is active, so
the grad norm, which must count each expert parameter once, steers the curve too."""
import re

import pytest

from tests.fixtures.tiny_gpt import run_pretrain
from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --make-vocab-size-divisible-by 32 --tokenizer-type NullTokenizer --mock-data --lr 1e-2 "
         "--train-iters 3 --swiglu "
         "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0 --eval-interval 1000 "
         "--num-workers 0 --global-batch-size 8 --micro-batch-size 2 --seed 1234 --disable-bias-linear "
         "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 "
         "--moe-shared-expert-intermediate-size 16 --clip-grad 0.05 --moe-grouped-gemm")

A2A = "--moe-token-dispatcher-type alltoall"
PER_TOKEN = f"{A2A} --calculate-per-token-loss"
VARIANTS = {  # router variant -> flags added to its reference and its layouts (prefix of the layout name)
    "no_aux": "--moe-aux-loss-coeff 0",
    "sigmoid_bias": "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                    "--moe-router-bias-update-rate 1e-2 --moe-router-load-balancing-type seq_aux_loss",
    "latent": "--moe-latent-size 16",
}
LAYOUTS = {  # name -> layout flags, all on 4 ranks (EP=2 on 4 ranks: expert-DP 2)
    "ep4": f"{A2A} --expert-model-parallel-size 4",
    "ep2_tp2_sp": f"{A2A} --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel",
    "ep2_pp2": f"{A2A} --expert-model-parallel-size 2 --pipeline-model-parallel-size 2",
    "etp2_ep2": f"{A2A} --tensor-model-parallel-size 2 --expert-tensor-parallel-size 2 --expert-model-parallel-size 2",
    "ep2_distopt": f"{A2A} --expert-model-parallel-size 2 --use-distributed-optimizer",
    "allgather_ep2_tp2": "--moe-token-dispatcher-type allgather --expert-model-parallel-size 2 "
                         "--tensor-model-parallel-size 2",
    "per_token_ep2_tp2_sp": f"{PER_TOKEN} --expert-model-parallel-size 2 --tensor-model-parallel-size 2 "
                            "--sequence-parallel",
    "cp2_dp2": f"{A2A} --context-parallel-size 2",
    "ep2_cp2": f"{A2A} --expert-model-parallel-size 2 --context-parallel-size 2",
    "no_aux_ep2_cp2": f"{A2A} --expert-model-parallel-size 2 --context-parallel-size 2 {VARIANTS['no_aux']}",
    "sigmoid_bias_ep2_cp2": f"{A2A} --expert-model-parallel-size 2 --context-parallel-size 2 "
                            f"{VARIANTS['sigmoid_bias']}",
    # Latent MoE: the projections' replicated weights see each TP rank's slice of the tokens (their grads summed
    # over TP), the all-to-all carries latent-wide rows.
    "latent_ep2_tp2_sp": f"{A2A} --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
                         f"{VARIANTS['latent']}",
    # EP=2 x DP (plain DDP) with two micro-batches per rank, the second forward beside the first backward,
    # and the experts' weight gradients behind the backward all-to-all. Without the aux loss, which is not
    # linear in the micro-batch (the others run one micro-batch of 2 per rank).
    "no_aux_ep2_overlap_delay": f"{A2A} --expert-model-parallel-size 2 --micro-batch-size 1 "
                                f"--overlap-moe-expert-parallel-comm --delay-wgrad-compute {VARIANTS['no_aux']}",
}


def _train(extra, cache):
    """pretrain_gpt's providers through pretrain(); per-iteration 'lm loss' and the printed log. The mock
    data's indices (a shuffle of its ~13M 16-token samples per split, ~0.7 s a rank) are built once in
    ``cache`` and read by every later run of the module."""
    losses = []

    def record(model, optimizer, out):
        if out[0]:
            losses.append(float(out[0]["lm loss"]))

    log = run_pretrain((MODEL + f" --data-cache-path {cache} " + extra).split(), record, capture_stdout=True)
    return losses, log


SAVE = "--save-interval 1 --exit-interval 1 --save"
RESHARD = {  # name -> (saving layout, loading layout flags)
    "ep4_to_ep1": ("ep4", f"{A2A} --expert-model-parallel-size 1"),
    "ep2_tp2_to_ep4": ("ep2_tp2_sp", f"{A2A} --expert-model-parallel-size 4"),
}


def _layouts(ckpt_root, cache):
    out = {}
    for name, flags in LAYOUTS.items():
        saving = [k for k, (src, _) in RESHARD.items() if src == name]
        extra = f" {SAVE} {ckpt_root}/{saving[0]}" if saving else ""
        out[name], log = _train(flags + extra, cache)
        if name == "ep4":
            out["_ep4_log"] = log
    for name, (_, flags) in RESHARD.items():
        out[name] = _train(f"{flags} --load {ckpt_root}/{name}", cache)[0]
    return out


def _references(cache):
    variants = {name: _train(f"{A2A} {flags}", cache)[0] for name, flags in VARIANTS.items()}
    return _train(A2A, cache), _train(PER_TOKEN, cache)[0], variants


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_data_cache"))
    ref, per_token_ref, variants = run_distributed(_references, 1, cache)[0]
    ref = (ref, per_token_ref, variants)
    layouts = run_distributed(_layouts, 4, str(tmp_path_factory.mktemp("moe_ckpt")), cache, timeout=900)
    return ref, layouts


def _close(a, b, rel=1e-5):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(y), f"iteration {i + 1}: {x} vs {y}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(runs, name):
    ((ref, _), per_token_ref, variants), layouts = runs
    ref = per_token_ref if name.startswith("per_token") else ref
    ref = next((losses for v, losses in variants.items() if name.startswith(v)), ref)
    losses = [r[name] for r in layouts if r[name]]  # ranks of the last pipeline stage
    assert losses
    saved_at_1 = any(src == name for src, _ in RESHARD.values())
    for rank_losses in losses:
        _close(rank_losses, ref[:1] if saved_at_1 else ref)


@pytest.mark.parametrize("name", list(RESHARD))
def test_checkpoint_reshards_and_training_continues(runs, name):
    ((ref, _), _, _), layouts = runs
    for rank in layouts:
        _close(rank[name], ref[1:])  # iterations 2 and 3 after loading the iteration-1 checkpoint


def test_log_line_has_moe_losses_and_load(runs):
    ((losses, log), per_token, variants), _ = runs
    assert per_token != losses  # --calculate-per-token-loss changes how MoE losses are weighted
    # The aux loss and the sigmoid router change the curve, so their CP layouts test what they say.
    assert variants["no_aux"] != losses and variants["sigmoid_bias"] != losses
    assert losses[-1] < losses[0]
    line = next(line for line in log.splitlines() if "iteration        2/" in line)
    assert line.index("lm loss:") < line.index("load_balancing_loss:") < line.index("z_loss:")
    assert "moe max load:" in line and "moe min load:" in line
    assert "moe max rank load:" not in line  # one process: no expert parallelism


def test_log_line_has_the_busiest_ep_ranks_load(runs):
    """At EP=4 the log adds the busiest EP rank's share of the expert tokens over the mean; each rank's share is
    the sum of its experts', so it lies between perfect balance and the busiest expert's share."""
    _, layouts = runs
    lines = [line for r in layouts for line in r["_ep4_log"].splitlines() if "iteration        1/" in line]
    assert lines
    for line in lines:
        rank_load = float(re.search(r"moe max rank load: (\S+) \|", line).group(1))
        max_load = float(re.search(r"moe max load: (\S+) \|", line).group(1))
        assert 1.0 <= rank_load <= max_load + 1e-6, line
