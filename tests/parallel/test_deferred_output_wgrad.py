"""--defer-embedding-wgrad-compute through pretrain() on 4 gloo ranks (fp32): the last pipeline stage parks its
output layer's weight-gradient GEMMs and runs them at the end of the step; the losses and grad norms equal the
run that computes them in each backward, for PP=2 x DP=2 with the distributed optimizer and --overlap-grad-reduce
(the bucket holding the output weight must wait for the parked GEMMs), PP=2 x TP=2 with sequence parallelism and
--wgrad-deferral-limit 1 (one GEMM parked per step, the others run at once), and the interleaved schedule with
tied embeddings. Each deferred run counts the GEMMs it parked, so a flag that parked nothing fails."""
import pytest

from tests.fixtures.tiny_gpt import mock_data_cache, run_pretrain
from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --tokenizer-type NullTokenizer --mock-data --lr 1e-2 --train-iters 3 "
         "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0 --eval-interval 1000 "
         "--num-workers 0 --global-batch-size 4 --micro-batch-size 1 --seed 1234 --clip-grad 1.0 "
         "--pipeline-model-parallel-size 2")
LAYOUTS = {  # name -> (layout flags, deferral flags, parked GEMMs per step on a last-stage rank)
    "pp2_dp2_distopt_overlap": ("--use-distributed-optimizer --overlap-grad-reduce "
                                "--untie-embeddings-and-output-weights", "", 2),
    "pp2_tp2_sp_limit1": ("--tensor-model-parallel-size 2 --sequence-parallel --untie-embeddings-and-output-weights",
                          "--wgrad-deferral-limit 1", 1),
    "pp2_vp2_dp2_tied": ("--num-layers-per-virtual-pipeline-stage 1 --overlap-grad-reduce", "", 2),
}


@pytest.fixture(scope="module", autouse=True)
def _mock_data_cache(tmp_path_factory):
    yield from mock_data_cache(tmp_path_factory)


def _train(extra):
    import megatron.core.tensor_parallel.layers as layers  # lazy: patched in the rank process only
    parked, park = [], layers._park_output_layer_input

    def counting(*args):
        slot = park(*args)
        parked.append(slot is not None)
        return slot

    steps = []

    def record(model, opt, out):
        if "lm loss" in out[0]:
            steps.append((float(out[0]["lm loss"]), float(out[2])))

    layers._park_output_layer_input = counting
    try:
        run_pretrain((MODEL + " " + extra).split(), record)
    finally:
        layers._park_output_layer_input = park
    return steps, sum(parked)


def _all_layouts():
    return {name: (_train(flags), _train(f"{flags} --defer-embedding-wgrad-compute {defer}"))
            for name, (flags, defer, _) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_layouts, 4)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deferred_output_wgrad_equals_the_plain_run(runs, name):
    last_stage = [r[name] for r in runs if r[name][0][0]]  # the ranks that log the loss
    assert len(last_stage) == 2
    for (plain, parked_plain), (deferred, parked) in last_stage:
        assert parked_plain == 0 and parked == 3 * LAYOUTS[name][2], (parked_plain, parked)
        assert len(plain) == len(deferred) == 3
        for i, ((loss, norm), (d_loss, d_norm)) in enumerate(zip(plain, deferred)):
            assert abs(d_loss - loss) <= 1e-6 * abs(loss), f"iteration {i + 1}: loss {d_loss} vs {loss}"
            assert abs(d_norm - norm) <= 1e-6 * abs(norm), f"iteration {i + 1}: grad norm {d_norm} vs {norm}"
    assert last_stage[0][1][0][-1][0] < last_stage[0][1][0][0][0]  # the loss falls
