"""--moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity at EP=2 (and EP=2 x expert-TP=2) on gloo
ranks, through pretrain(): every expert receives exactly its capacity from every rank, so the all-to-all dispatcher
knows its split sizes without gathering the token counts or reading them on the host (on a GPU each read waits
for the device). The run equals the same run with the counts gathered and read (bitwise: the same rows in the
same order), and reads none."""
import pytest

from tests.fixtures.tiny_gpt import mock_data_cache, run_pretrain
from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --make-vocab-size-divisible-by 32 --tokenizer-type NullTokenizer --mock-data --lr 1e-2 "
         "--train-iters 3 --swiglu --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0 "
         "--eval-interval 1000 --num-workers 0 --micro-batch-size 1 --seed 1234 --disable-bias-linear "
         "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm "
         "--moe-token-dispatcher-type alltoall --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity")
LAYOUTS = {
    2: ("ep2", "--expert-model-parallel-size 2 --global-batch-size 8"),
    4: ("ep2_etp2", "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 2 "
                    "--sequence-parallel --global-batch-size 4"),
}


def _runs(flags):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    out = {}
    static, read = MoEAlltoAllTokenDispatcher._static_counts, MoEAlltoAllTokenDispatcher._read_counts
    reads = []

    def counted_read(self, pending):
        reads.append(1)
        return read(self, pending)

    MoEAlltoAllTokenDispatcher._read_counts = counted_read
    try:
        for name, exchange in (("static", False), ("exchanged", True)):
            MoEAlltoAllTokenDispatcher._static_counts = (lambda self, n: None) if exchange else static
            curve = []
            del reads[:]
            run_pretrain((MODEL + " " + flags).split(),
                         lambda model, optimizer, result: curve.append((float(result[0]["lm loss"]),
                                                                        float(result[2]))))
            out[name] = (curve, len(reads))
    finally:
        MoEAlltoAllTokenDispatcher._static_counts, MoEAlltoAllTokenDispatcher._read_counts = static, read
    return out


@pytest.fixture(scope="module", autouse=True)
def _mock_data_cache(tmp_path_factory):
    yield from mock_data_cache(tmp_path_factory)


@pytest.mark.parametrize("world", [2, 4])
def test_padded_capacity_needs_no_count_exchange(world):
    name, flags = LAYOUTS[world]
    for rank in run_distributed(_runs, world, flags, timeout=600):
        static, exchanged = rank["static"], rank["exchanged"]
        assert len(static[0]) == 3 and static[0] == exchanged[0], name  # losses and grad norms, bitwise
        assert static[1] == 0 and exchanged[1] > 0, name
