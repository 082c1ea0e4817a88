"""--test-mode on gloo ranks: replicated parameters pass (TP-split and expert-parallel ones are not compared where
they differ by design), and one flipped bit in one rank's copy is named in one line with its group and ranks, on
every rank; through pretrain() at TP=2 with sequence parallelism, a clean run passes its checks and a drifted
layernorm stops the run."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed.replica_checks import find_replica_mismatch, fingerprint, replicated_params
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import mock_data_cache, run_pretrain, tiny_config, tiny_gpt
from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --make-vocab-size-divisible-by 32 --tokenizer-type NullTokenizer --mock-data --lr 1e-2 "
         "--train-iters 4 --hidden-dropout 0 --attention-dropout 0 --log-interval 2 --eval-iters 0 "
         "--eval-interval 1000 --num-workers 0 --global-batch-size 4 --micro-batch-size 2 --seed 1234 "
         "--tensor-model-parallel-size 2 --sequence-parallel --test-mode").split()
NORM = "decoder.layers.0.input_layernorm.weight"


@pytest.fixture(scope="module", autouse=True)
def _mock_data_cache(tmp_path_factory):
    yield from mock_data_cache(tmp_path_factory)


def _flip_low_bit(param):
    """The smallest corruption there is: the last mantissa bit of one element."""
    with torch.no_grad():
        bits = param.data.view(-1).view(torch.int32)
        bits[0] ^= 1


def test_fingerprint_sees_one_bit_and_a_swap():
    x = torch.randn(1000)
    y = x.clone()
    y.view(torch.int32)[500] ^= 1
    z = x.clone()
    z[3], z[4] = x[4], x[3]
    assert torch.equal(fingerprint(x), fingerprint(x.clone()))
    assert not torch.equal(fingerprint(x), fingerprint(y)) and not torch.equal(fingerprint(x), fingerprint(z))
    nan = torch.full((4,), float("nan"), dtype=torch.bfloat16)  # NaN copies still match bit for bit
    assert torch.equal(fingerprint(nan), fingerprint(nan.clone()))


def _check(sizes, flip_rank, flip_name, moe=False):
    """(verdict on identical replicas, verdict after flipping ``flip_name`` on ``flip_rank``)."""
    ps.initialize_model_parallel(**sizes)
    try:
        model_parallel_cuda_manual_seed(1234)
        extra = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                     moe_token_dispatcher_type="alltoall") if moe else {}
        model = tiny_gpt(tiny_config(**sizes, **extra), spec=get_gpt_layer_local_spec(num_experts=4 if moe else None))
        clean = find_replica_mismatch(model)
        if torch.distributed.get_rank() == flip_rank:
            _flip_low_bit(dict(model.named_parameters())[flip_name])
        return clean, find_replica_mismatch(model), _expert_fingerprint(model) if moe else None
    finally:
        ps.destroy_model_parallel()


def _expert_fingerprint(model):
    return fingerprint(replicated_params(model)["edp"][0][1]).tolist()


def _two_ranks():
    """Every 2-rank case in one launch (starting ranks costs more than the cases)."""
    return {"tp": _check(dict(tensor_model_parallel_size=2), 1, NORM),
            "dp": _check({}, 1, "decoder.layers.1.mlp.linear_fc2.weight"), **_pretrain_runs()}


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_two_ranks, 2, timeout=300)


def test_two_ranks_tp_and_dp(two_ranks):
    for rank_result in two_ranks:
        assert rank_result["tp"][0] is None and rank_result["dp"][0] is None
        assert rank_result["tp"][1] == (f"parameter {NORM} differs across the tp group (ranks [0, 1]): "
                                        f"rank 1 does not match rank 0")
        assert rank_result["dp"][1] == ("parameter decoder.layers.1.mlp.linear_fc2.weight differs across the dp "
                                        "group (ranks [0, 1]): rank 1 does not match rank 0")


def _four_ranks_moe():
    return _check(dict(expert_model_parallel_size=2), 3,
                  "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", moe=True)


def test_four_ranks_experts_compared_over_edp_only():
    """EP=2 x DP=4: the two expert-parallel ranks own different experts (no false alarm); a flipped expert weight
    is found over its expert data-parallel pair."""
    results = run_distributed(_four_ranks_moe, 4)
    assert all(clean is None for clean, _, _ in results)
    fps = [fp for _, _, fp in results]
    assert fps[0] != fps[1]  # ranks 0 and 1 hold different experts: a DP-wide comparison would fail
    for _, bad, _ in results:
        assert bad is not None and "differs across the edp group" in bad and "rank 3 does not match rank 1" in bad, bad


def _pretrain_runs():
    logs = {"clean": run_pretrain(MODEL, capture_stdout=True)}

    def drift(model, optimizer, result):  # rank 1's copy of a norm weight moves by one bit after the first step
        if torch.distributed.get_rank() == 1 and not getattr(drift, "done", False):
            drift.done = True
            _flip_low_bit(dict(model[0].named_parameters())[f"module.{NORM}"])
    try:
        run_pretrain(MODEL, on_step=drift)
        logs["drift"] = "no error"
    except RuntimeError as e:
        logs["drift"] = str(e)
    return logs


def test_pretrain_checks_and_stops_on_drift(two_ranks):
    for rank, logs in enumerate(two_ranks):
        if rank == 0:
            assert ("--test-mode: replicated parameters identical across dp/edp/tp/etp ranks after 0 iterations; "
                    "checked again every 2 iterations") in logs["clean"], logs["clean"][-2000:]
        assert logs["drift"] == (f"--test-mode: parameter module.{NORM} differs across the tp group (ranks [0, 1]): "
                                 f"rank 1 does not match rank 0 after 2 iterations"), logs["drift"]
