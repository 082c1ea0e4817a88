"""Who writes which chunk in a fully parallel save (fully_parallel.assign_writers)."""
from megatron.core.dist_checkpointing.strategies.fully_parallel import assign_writers


def _sid(key):
    return key, (0,), (1,)


def test_replicated_chunks_balance_and_own_chunks_stay():
    # Both ranks hold weights a (40 B), b (30 B), c (20 B), d (10 B); main replica on rank 0 only.
    # Each also holds its own optimizer range (25 B), written by itself.
    shared = [("a", 40), ("b", 30), ("c", 20), ("d", 10)]
    r0 = [(_sid(k), True, n) for k, n in shared] + [(_sid("opt0"), True, 25)]
    r1 = [(_sid(k), False, n) for k, n in shared] + [(_sid("opt1"), True, 25)]
    writer = assign_writers([r0, r1])
    assert writer[_sid("opt0")] == 0 and writer[_sid("opt1")] == 1
    loads = [0, 0]
    for key, n in shared + [("opt0", 25), ("opt1", 25)]:
        loads[writer[_sid(key)]] += n
    assert loads == [75, 75]


def test_chunks_no_rank_of_the_group_writes_stay_unwritten():
    # A TP-replicated norm held by this DP group as a non-main replica everywhere (TP rank 1's group).
    gathered = [[(_sid("norm"), False, 8)], [(_sid("norm"), False, 8)]]
    assert assign_writers(gathered) == {}
