import pytest
import torch

from tests.parallel.dist_utils import run_distributed


def _all_reduce_rank():
    t = torch.tensor([float(torch.distributed.get_rank())])
    torch.distributed.all_reduce(t)
    return t.item()


def _fail_on_rank_one():
    if torch.distributed.get_rank() == 1:
        raise ValueError("boom on rank one")
    return 0


def test_results_in_rank_order():
    assert run_distributed(_all_reduce_rank, 3) == [3.0, 3.0, 3.0]


def test_failure_names_rank():
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_distributed(_fail_on_rank_one, 2)
