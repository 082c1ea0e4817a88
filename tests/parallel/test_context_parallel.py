"""Context parallelism and packed documents on CPU (fp32, gloo): one spawned world of 4 ranks runs
every case.

1. Attention (cp_attention_cases.py): ring / allgather / a2a at CP=2 and CP=4, hierarchical a2a+p2p at
   every split of 2 and 4 ranks, with and without packed documents, and packed documents without CP,
   against SDPA over the whole sequence run per document: output and q/k/v grads within 1e-5 absolute
   (O(1) values; only the fp32 summation order differs).
2. Training through pretrain(): each layout reproduces CP=1's per-iteration loss within 1e-5 relative
   (the same global batch; CP=1 runs as DP=4, DP invariance being tested elsewhere). Layouts: CP=4 with
   p2p, allgather and a2a (one per layer, so one run trains through each comm type) and a2a+p2p [2, 2],
   CP=2 x DP=2 with the distributed optimizer and per-layer comm types,
   CP=2 x TP=2 with SP (p2p, and a2a+p2p [2, 1]), CP=2 x PP=2 interleaved, and packed documents
   (--reset-attention-mask --reset-position-ids --eod-mask-loss) at CP=2 x PP=2 and at CP=4 a2a+p2p [2, 2]
   mixed per layer with p2p and a2a, against packed CP=1.
3. A checkpoint saved at CP=2 x DP=2 (distributed optimizer) after iteration 1 resumes at CP=1 x DP=4 with
   CP=1's losses.
"""
import numpy
import pytest

from tests.parallel.cp_attention_cases import attention_errors, hierarchical_attention_errors, module_errors
from tests.parallel.dist_utils import run_distributed
from tests.parallel.test_training_invariance import MODEL, _train

# A global batch of 4 (one micro-batch per rank at CP=1 x DP=4, four at CP=4): every layout still accumulates
# over micro-batches, at half the cost of 8.
BASE = (MODEL.replace("--mock-data ", "").replace("--eval-iters 1", "--eval-iters 0").replace("--train-iters 6", "")
        .replace("--global-batch-size 8", "--global-batch-size 4"))
GPT = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
       "--seq-length 32 --max-position-embeddings 32 --position-embedding-type rope --normalization RMSNorm "
       "--swiglu --micro-batch-size 1 --train-iters 3 --make-vocab-size-divisible-by 64 ")  # vocab 128 at TP 1 and 2
PACKED = "--reset-attention-mask --reset-position-ids --eod-mask-loss "
LAYOUTS = {
    # each comm type at CP=4 in one run (the attention cases above compare each one alone, layer by layer)
    "cp4_p2p_allgather_a2a_per_layer": "--context-parallel-size 4 --cp-comm-type p2p allgather a2a p2p",
    "cp2_dp2_distopt_per_layer": "--context-parallel-size 2 --use-distributed-optimizer "
                                 "--cp-comm-type p2p allgather a2a p2p",
    "cp2_tp2_sp": "--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel",
    "cp2_pp2_interleaved": "--context-parallel-size 2 --pipeline-model-parallel-size 2 "
                           "--num-layers-per-virtual-pipeline-stage 1",
    "cp4_a2a_p2p_2x2": "--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2",
    # 2 heads and 1 K/V group per TP rank: the all-to-all over 2 ranks repeats K/V per query head
    "cp2_tp2_sp_a2a_p2p_2x1": "--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
                              "--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 1",
}
PACKED_LAYOUTS = {
    "packed_cp2_pp2": "--context-parallel-size 2 --pipeline-model-parallel-size 2",
    "packed_cp4_a2a_p2p_2x2_per_layer": "--context-parallel-size 4 --hierarchical-context-parallel-sizes 2 2 "
                                        "--cp-comm-type a2a+p2p p2p a2a+p2p a2a",
}


def _write_corpus(prefix):
    """Short documents (1-20 tokens + EOD, id 127 of the null tokenizer): several per 32-token sample."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for _ in range(1500):
        builder.add_item(numpy.append(rng.integers(0, 127, size=int(rng.integers(1, 20))), 127))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _world(prefix, cache):
    out = {"attention": attention_errors(), "hierarchical": hierarchical_attention_errors(),
           "module": module_errors()}
    data = f"--data-path {prefix} --split 100,0,0 --data-cache-path {cache} "
    runs = [("cp1", ""), ("packed_cp1", PACKED)] + list(LAYOUTS.items())
    runs += [(name, PACKED + flags) for name, flags in PACKED_LAYOUTS.items()]
    for name, flags in runs:
        out[name] = _train(GPT + data + flags, base=BASE)
    # Checkpoints do not depend on CP: save at CP=2 x DP=2 after 1 iteration, resume at CP=1 x DP=4 (iteration
    # 3's loss follows iteration 2's update, which uses the Adam moments of the checkpoint).
    save = f"--use-distributed-optimizer --save {cache}/ckpt --save-interval 1 "
    _train(GPT + data + save + "--context-parallel-size 2 --train-iters 1 --lr-decay-iters 3", base=BASE)
    out["resumed_at_cp1"] = _train(GPT + data + f"--use-distributed-optimizer --load {cache}/ckpt "
                                   "--use-checkpoint-opt-param-scheduler", base=BASE)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    _write_corpus(str(tmp / "docs"))
    return run_distributed(_world, 4, str(tmp / "docs"), str(tmp / "cache"), timeout=900)


def test_attention_matches_whole_sequence_attention(world):
    for rank_result in world:
        for case, err in rank_result["attention"].items():
            assert err < 1e-5, f"(cp, comm type, documents) = {case}: max abs error {err}"


def test_hierarchical_attention_matches_whole_sequence_attention(world):
    """a2a+p2p at [2, 2], [4, 1], [1, 4], [2, 1], [1, 2], with and without documents: same bound."""
    for rank_result in world:
        for case, err in rank_result["hierarchical"].items():
            assert err < 1e-5, f"(a2a size, p2p size, documents) = {case}: max abs error {err}"
        for docs, err in rank_result["module"].items():  # DotProductAttention, explicit pg_collection, [2, 2]
            assert err < 1e-5, f"DotProductAttention a2a+p2p (documents={docs}): max abs error {err}"


def _close(a, b, rel=1e-5):
    assert len(a) == len(b) == 3
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(y), f"iteration {i + 1}: {x} vs {y}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_cp1(world, name):
    _close(world[-1][name], world[-1]["cp1"])  # the last rank is on the last pipeline stage


@pytest.mark.parametrize("name", list(PACKED_LAYOUTS))
def test_packed_layout_matches_cp1(world, name):
    _close(world[-1][name], world[-1]["packed_cp1"])
    assert world[-1]["packed_cp1"] != world[-1]["cp1"]  # documents really changed the attention


def test_checkpoint_saved_at_cp2_resumes_at_cp1(world):
    resumed, reference = world[-1]["resumed_at_cp1"], world[-1]["cp1"]
    assert len(resumed) == 2  # iterations 2 and 3
    for x, y in zip(resumed, reference[1:]):
        assert abs(x - y) <= 1e-5 * abs(y), f"{resumed} vs {reference[1:]}"
