"""Configuration shared by every dataset the builder makes (`BlendedMegatronDatasetConfig`)."""
import functools
import logging
import re
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)


@dataclass
class BlendedMegatronDatasetConfig:
    """Fields mirror Megatron Core; `blend` is (prefixes, weights or None) as from get_blend_from_list."""

    random_seed: int
    sequence_length: int
    blend: Optional[Tuple[List[str], Optional[List[float]]]] = None
    blend_per_split: Optional[List[Optional[Tuple[List[str], Optional[List[float]]]]]] = None
    multiple_validation_sets: Optional[bool] = None
    """The valid split's prefixes (blend_per_split, no weights) become separate datasets, evaluated one by one."""
    full_validation: Optional[bool] = None
    """Each evaluation reads one whole epoch of the validation set(s) (the caller asks for size None)."""
    split: Optional[str] = None
    split_matrix: Optional[List[Tuple[float, float]]] = field(init=False, default=None)
    num_dataset_builder_threads: int = 1
    path_to_cache: Optional[str] = None
    mmap_bin_files: bool = True
    mock: bool = field(init=False, default=False)
    tokenizer: Optional[MegatronTokenizer] = None
    mid_level_dataset_surplus: float = 0.005
    allow_ambiguous_pad_tokens: Optional[bool] = False
    # Megatron's index-loading speedups (lazy .npy index mmaps, a one-file cache); the indices, hence
    # the samples, are the same either way, so here they have no effect.
    defer_npy_index_mmap: bool = False
    fast_cache_load: bool = False

    def __post_init__(self):
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None or self.split is not None:
                raise ValueError("--train/valid/test-data-path cannot be combined with --data-path or --split")
            if len(self.blend_per_split) != len(Split):
                raise ValueError(f"blend_per_split needs {len(Split)} entries (train, valid, test)")
            for split, blend in zip(Split, self.blend_per_split):
                if blend is not None and blend[1] is not None and len(blend[0]) != len(blend[1]):
                    raise ValueError(f"{split.name} data path: as many weights as prefixes are required")
            valid = self.blend_per_split[Split.valid.value]
            if self.multiple_validation_sets and valid is not None and valid[1] is not None:
                raise ValueError("--multiple-validation-sets evaluates each --valid-data-path prefix on its own: "
                                 "list the prefixes without weights")
        else:
            if self.multiple_validation_sets:
                raise ValueError("--multiple-validation-sets needs the validation sets as --valid-data-path prefixes "
                                 "(with --train-data-path), not --data-path with --split")
            if self.blend is not None:
                if self.blend[1] is not None and len(self.blend[0]) != len(self.blend[1]):
                    raise ValueError("--data-path: as many weights as prefixes are required")
                if self.split is None:
                    raise ValueError("--split is required with --data-path (e.g. --split 969,30,1)")
            else:
                self.mock = True
                if self.split is None:
                    self.split = "1,1,1"
        if self.split is not None:
            split_vector = parse_and_normalize_split(self.split)
            self.split_matrix = convert_split_vector_to_split_matrix(split_vector)
            log_single_rank(logger, logging.INFO, f"Let split_matrix = {self.split_matrix}")


def parse_and_normalize_split(split: str) -> List[float]:
    """'99,1,0' or '99/1' -> normalised [train, valid, test] fractions."""
    values = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if len(values) > len(Split) or not values or sum(values) <= 0:
        raise ValueError(f"--split '{split}': give up to 3 non-negative numbers with a positive sum, e.g. 969,30,1")
    values = values + [0.0] * (len(Split) - len(values))
    return normalize(values)


def convert_split_vector_to_split_matrix(vector_a: List[float], vector_b: Optional[List[float]] = None
                                         ) -> List[Optional[Tuple[float, float]]]:
    """[.9, .09, .01] -> [(0, .9), (.9, .99), (.99, 1)]; an empty range becomes None."""
    if vector_b is None:
        vector_b = vector_a
    # cumulative sums by sequential addition (same float rounding as Megatron)
    expand = lambda v: functools.reduce(lambda acc, x: acc + [acc[-1] + x], v, [0])
    ends_a, ends_b = expand(vector_a), expand(vector_b)
    matrix = []
    for (a0, a1), (b0, b1) in zip(zip(ends_a[:-1], ends_a[1:]), zip(ends_b[:-1], ends_b[1:])):
        lo, hi = max(a0, b0), min(a1, b1)
        matrix.append(None if hi <= lo else (lo, hi))
    return matrix
