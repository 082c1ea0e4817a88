"""Pipeline layer assignment: even, virtual (interleaved), uneven first/last, embedding/loss slots."""
import pytest

from megatron.core import parallel_state as ps
from megatron.core.transformer.transformer_block import get_num_layers_to_build, get_transformer_layer_offset
from tests.fixtures.tiny_gpt import tiny_config


@pytest.fixture
def pp():
    def set_pp(size):
        ps.set_pipeline_model_parallel_world_size(size)
    yield set_pp
    ps.set_pipeline_model_parallel_world_size(None)


def _layout(cfg, pp_size, vp_size=1):
    return [[(get_num_layers_to_build(cfg, vp, r), get_transformer_layer_offset(cfg, vp, r))
             for r in range(pp_size)] for vp in range(vp_size)]


def _cfg(num_layers, pp_size, **kw):
    return tiny_config(num_layers=num_layers, hidden_size=8, num_attention_heads=2,
                       pipeline_model_parallel_size=pp_size, **kw)


def test_even_and_virtual(pp):
    pp(2)
    assert _layout(_cfg(4, 2), 2) == [[(2, 0), (2, 2)]]
    # 8 layers, PP=2, VPP=2: rank 0 builds 0-1 and 4-5, rank 1 builds 2-3 and 6-7.
    cfg = _cfg(8, 2, virtual_pipeline_model_parallel_size=2)
    assert _layout(cfg, 2, 2) == [[(2, 0), (2, 2)], [(2, 4), (2, 6)]]


def test_uneven_first_last(pp):
    pp(3)
    cfg = _cfg(7, 3, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=2)
    assert _layout(cfg, 3) == [[(1, 0), (4, 1), (2, 5)]]


def test_account_for_embedding_and_loss(pp):
    pp(4)
    cfg = _cfg(6, 4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert _layout(cfg, 4) == [[(1, 0), (2, 1), (2, 3), (1, 5)]]


@pytest.mark.parametrize("size,kw", [(2, dict(num_layers=5)),
                                     (2, dict(num_layers=6, virtual_pipeline_model_parallel_size=2)),
                                     (3, dict(num_layers=6, num_layers_in_first_pipeline_stage=1))])
def test_layers_that_do_not_divide_raise(pp, size, kw):
    pp(size)
    n = kw.pop("num_layers")
    with pytest.raises(ValueError):
        get_num_layers_to_build(_cfg(n, size, **kw), 0, 0)
