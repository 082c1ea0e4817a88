"""One 2-rank gloo world: --use-cpu-initialization gives today's values at TP=1 and TP=2, and every
--use-megatron-fsdp sharding strategy trains like plain DDP through pretrain() (DP=2).

fp32 on CPU, dropout 0, same seed and data: DDP, the distributed optimizer and FSDP2 only reorder the
same sums (all-reduce vs reduce-scatter + all-gather), so losses and grad norms agree to ~1e-7; 1e-5
relative is the bound the other data-parallel invariance tests use.
"""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import mock_data_cache, run_pretrain, tiny_config, tiny_gpt
from tests.parallel.dist_utils import run_distributed

ITERS = 3
MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --tokenizer-type NullTokenizer --mock-data --lr 1e-3 --hidden-dropout 0 "
         f"--attention-dropout 0 --log-interval 10 --eval-iters 0 --num-workers 0 --train-iters {ITERS} "
         "--micro-batch-size 2 --global-batch-size 8 --seed 1234")
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]

@pytest.fixture(scope="module", autouse=True)
def _mock_data_cache(tmp_path_factory):
    """Every run of the module reads the mock data's indices built by its first run."""
    yield from mock_data_cache(tmp_path_factory)



def _init_values(tp, cpu_init):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    cfg = tiny_config(tensor_model_parallel_size=tp, use_cpu_initialization=cpu_init)
    model = tiny_gpt(cfg, vocab_size=128, max_sequence_length=16, share_embeddings_and_output_weights=False)
    devices = {p.device.type for p in model.parameters()}
    ps.destroy_model_parallel()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}, devices


def _train(extra):
    """pretrain_gpt's providers through pretrain(): per-iteration (lm loss, grad norm), engine names."""
    record, engines = [], set()

    def on_step(model, optimizer, out):
        record.append((float(out[0]["lm loss"]), float(out[2])))
        engines.update({type(model[0]).__name__, type(optimizer).__name__})
    run_pretrain((MODEL + " " + extra).split(), on_step)
    return record, sorted(engines)


def _world():
    init = {(tp, cpu): _init_values(tp, cpu) for tp in (1, 2) for cpu in (False, True)}
    runs = {"ddp": _train("")}
    for strategy in STRATEGIES:
        # Megatron-FSDP launch scripts also pass --use-distributed-optimizer: the strategy decides.
        runs[strategy] = _train(f"--use-megatron-fsdp --use-distributed-optimizer --data-parallel-sharding-strategy "
                                f"{strategy}")
    return init, runs


@pytest.fixture(scope="module")
def world():
    return run_distributed(_world, 2, timeout=600)


@pytest.mark.parametrize("tp", [1, 2])
def test_cpu_initialization_same_values(world, tp):
    for rank_result in world:
        init = rank_result[0]
        (default, _), (cpu, devices) = init[(tp, False)], init[(tp, True)]
        assert devices == {"cpu"} and default.keys() == cpu.keys()
        for name in default:
            assert torch.equal(default[name], cpu[name]), name


@pytest.mark.parametrize("strategy,engine", [
    ("no_shard", "DistributedDataParallel"), ("optim", "DistributedOptimizer"),
    ("optim_grads", "TorchFullyShardedDataParallel"), ("optim_grads_params", "TorchFullyShardedDataParallel")])
def test_megatron_fsdp_strategy_matches_ddp(world, strategy, engine):
    runs = world[0][1]
    (ddp, _), (run, engines) = runs["ddp"], runs[strategy]
    assert engine in engines, engines
    assert len(run) == len(ddp) == ITERS and len({loss for loss, _ in ddp}) == ITERS  # it trains
    torch.testing.assert_close(torch.tensor(run, dtype=torch.float64), torch.tensor(ddp, dtype=torch.float64),
                               rtol=1e-5, atol=0)
    assert world[1][1][strategy][0] == run  # both ranks log the same DP-reduced loss and norm
