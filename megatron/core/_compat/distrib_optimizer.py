"""Megatron Core's ``distrib_optimizer.Range``: the distributed optimizer here keeps plain (start, end)
tuples. Reached from ``megatron.core.optimizer.distrib_optimizer`` through its lazy alias table.
"""


class Range:
    """A [start, end) span of a flat buffer."""

    def __init__(self, start: int, end: int):
        self.start, self.end, self.size = start, end, end - start

    def normalize(self, start: int = 0) -> "Range":
        """The same size, moved to begin at ``start``."""
        return Range(start, start + self.size)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"{self.start},{self.end} [{self.size}]"
