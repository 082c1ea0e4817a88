"""A distributed optimizer's flat range of a param, as boxes of the param's tensor (optimizer_state.py)."""
import math

import pytest
import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer.optimizer_state import _loaded_value, _range_pieces, flat_range_boxes


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (2, 1, 3, 5)])
def test_boxes_cover_the_range_once_in_order(shape):
    n = math.prod(shape)
    for lo in range(n):
        for hi in range(lo, n + 1):
            covered = torch.zeros(shape, dtype=torch.int)
            at = lo
            for offset, size in flat_range_boxes(shape, lo, hi):
                start = sum(o * math.prod(shape[i + 1:]) for i, o in enumerate(offset))
                assert start == at  # each box continues the range where the previous one ended
                at += math.prod(size)
                covered[tuple(slice(o, o + z) for o, z in zip(offset, size))] += 1
            expected = torch.zeros(n, dtype=torch.int)
            expected[lo:hi] = 1
            assert at == hi and torch.equal(covered.reshape(-1), expected), (shape, lo, hi)
            assert len(flat_range_boxes(shape, lo, hi)) <= 2 * len(shape) - 1


def test_pieces_carry_global_offsets_and_join_back():
    # Rows 4..7 of a [8, 5] tensor split over TP (this rank: global rows 4..7), DP rank 1 of its replicas.
    param = torch.arange(20.0).reshape(4, 5)
    st = ShardedTensor.from_rank_offsets("w", param, (0, 1, 2), replica_id=(0, 0, 1))
    flat = param.reshape(-1)[3:17]
    pieces = _range_pieces(st, "optimizer.state.exp_avg.w", 3, 17, flat)
    full = torch.zeros(8, 5)
    for p in pieces.values():
        assert p.replica_id == (0, 0, 0) and p.global_shape == (8, 5)  # every DP rank writes its own range
        full[p.global_slice()] = p.data
    expected = torch.zeros(8, 5)
    expected[4:8].view(-1)[3:17] = flat
    assert torch.equal(full, expected)
    assert torch.equal(_loaded_value({k: v.data for k, v in pieces.items()}, param), flat)


def test_range_pieces_of_a_gated_fc1_map_to_megatrons_stacked_layout():
    """Pieces of our [2, f, h] SwiGLU fc1 state land where Megatron's [L, 2f, h] tensor keeps those values."""
    from megatron.core.dist_checkpointing.megatron_layout import to_megatron_layout

    fc1 = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)  # [gate/up, f, h], TP=1
    st = ShardedTensor.from_rank_offsets("decoder.layers.1.mlp.linear_fc1.weight", fc1, replica_id=(0, 0, 1))
    stacked = torch.full((2, 12, 3), -1.0)  # Megatron's [L, 2f, h]
    for lo, hi in ((0, 13), (13, 29), (29, 36)):  # three DP ranks' ranges, the middle one crossing gate -> up
        pieces = _range_pieces(st, st.key, lo, hi, fc1.reshape(-1)[lo:hi])
        for sh in to_megatron_layout(pieces, num_layers=2, extra_state=False).values():
            assert sh.key == "decoder.layers.mlp.linear_fc1.weight" and sh.global_shape == (2, 12, 3)
            stacked[sh.global_slice()] = sh.data
    assert torch.equal(stacked[1], torch.cat([fc1[0], fc1[1]]))


def test_pieces_read_in_place_join_without_a_copy():
    """Pieces loaded into the live flat state are that state again (no second copy of the optimizer state on
    the device); pieces in separate buffers, or out of order, are joined by copying."""
    param = torch.zeros(4, 5)
    st = ShardedTensor.from_rank_offsets("w", param, (0, 1, 2), replica_id=(0, 0, 1))
    storage = torch.arange(30.0)
    flat = storage[6:20]  # a range of a larger flat buffer, as the distributed optimizer's state is
    pieces = {k: v.data for k, v in _range_pieces(st, "optimizer.state.exp_avg.w", 3, 17, flat).items()}
    assert len(pieces) == 3
    joined = _loaded_value(pieces, param)
    assert torch.equal(joined, flat)
    assert joined.data_ptr() == flat.data_ptr() and joined.untyped_storage().data_ptr() == storage.data_ptr()
    copies = {k: v.clone() for k, v in pieces.items()}
    joined = _loaded_value(copies, param)
    assert torch.equal(joined, flat) and joined.data_ptr() != flat.data_ptr()
    first, second, third = sorted(pieces)
    swapped = {first: pieces[first], second: pieces[third].clone(), third: pieces[third]}  # not back to back
    assert not torch.equal(_loaded_value(swapped, param), flat)


def test_main_params_are_read_into_the_gradient_buffer():
    """A load reads a distributed optimizer's fp32 main params into the param's fp32 gradient buffer (idle until
    the next step zeroes it) rather than a new buffer of the optimizer state's size; not into a bf16 one."""
    from megatron.core.optimizer.optimizer_state import _main_param_read_buffer
    param = torch.nn.Parameter(torch.zeros(4, 5, dtype=torch.bfloat16))
    main = torch.zeros(7)
    assert _main_param_read_buffer(param, 3, 10, main).shape == (7,)  # no gradient buffer: a new one
    grads = torch.zeros(30)
    param.main_grad = grads[5:25].view(4, 5)
    buf = _main_param_read_buffer(param, 3, 10, main)
    assert buf.shape == (7,) and buf.data_ptr() == grads[8:].data_ptr()
    param.main_grad = torch.zeros(4, 5, dtype=torch.bfloat16)  # --grad-reduce-in-bf16
    buf = _main_param_read_buffer(param, 3, 10, main)
    assert buf.dtype == torch.float32 and buf.untyped_storage().data_ptr() != param.main_grad.data_ptr()
