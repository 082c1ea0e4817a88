"""--check-weight-hash-across-dp-replicas-interval on 2 gloo ranks (DP=2), through pretrain(): identical replicas
pass at the start and every N iterations (also with the distributed optimizer's overlapped param gather, whose
all-gathers are waited for first); a replica whose weight drifted stops every rank with the parameter named."""
import pytest
import torch

from tests.fixtures.tiny_gpt import mock_data_cache, run_pretrain
from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --make-vocab-size-divisible-by 32 --tokenizer-type NullTokenizer --mock-data --lr 1e-2 "
         "--train-iters 4 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0 "
         "--eval-interval 1000 --num-workers 0 --global-batch-size 4 --micro-batch-size 1 --seed 1234 "
         "--check-weight-hash-across-dp-replicas-interval 2").split()

@pytest.fixture(scope="module", autouse=True)
def _mock_data_cache(tmp_path_factory):
    """Every run of the module reads the mock data's indices built by its first run."""
    yield from mock_data_cache(tmp_path_factory)



def _runs():
    logs = {"plain": run_pretrain(MODEL, capture_stdout=True),
            "distopt": run_pretrain(MODEL + ["--use-distributed-optimizer", "--overlap-param-gather",
                                             "--overlap-grad-reduce"], capture_stdout=True)}

    def drift(model, optimizer, result):  # rank 1's copy of one weight moves after the first step
        if torch.distributed.get_rank() == 1 and not getattr(drift, "done", False):
            drift.done = True
            with torch.no_grad():
                dict(model[0].named_parameters())["module.decoder.layers.1.mlp.linear_fc2.weight"].add_(1e-3)
    try:
        run_pretrain(MODEL, on_step=drift)
        logs["drift"] = "no error"
    except RuntimeError as e:
        logs["drift"] = str(e)
    return logs


def test_replicas_checked_and_drift_named():
    for rank, logs in enumerate(run_distributed(_runs, 2, timeout=600)):
        for name in ("plain", "distopt"):
            if rank == 0:
                for it in (0, 2, 4):
                    assert f">>> Weight hashes match after {it} iterations..." in logs[name], logs[name][-2000:]
        assert logs["drift"].startswith("--check-weight-hash-across-dp-replicas-interval: parameter hashes differ "
                                        "across data-parallel replicas after 2 iterations"), logs["drift"]
        assert "decoder.layers.1.mlp.linear_fc2.weight" in logs["drift"], logs["drift"]
