"""`--fim-data`: GPT samples rewritten into fill-in-the-middle order (Megatron-LM's GPTFIMDataset names).

GPTFIMDataset reads the same documents, sample index and shuffle as GPTDataset (same samples in the same
order), then rewrites each sample with fim_permute.FIMPermuter. Megatron-LM draws every FIM decision from one
RandomState per dataset, so a sample's rewrite depends on which samples the same data-loader worker read
before it (and on the worker count, and on where a run resumed). Here each sample draws from its own
RandomState seeded with (--seed, data prefix and split, sample index): the rewrite of sample i is fixed by
the data and the seed alone, and a resumed run sees the same samples as an uninterrupted one.
"""
import zlib
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy

from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.training.datasets.fim_permute import FIMPermuter, FIMTokenIds

# fim_extra_tokens key -> the flag that names the token (for the error messages)
TOKEN_FLAGS = {"prefix": "--fim-prefix-token", "middle": "--fim-middle-token", "suffix": "--fim-suffix-token",
               "pad": "--fim-pad-token", "eod": "--fim-eod-token"}


@dataclass
class GPTFIMDatasetConfig(GPTDatasetConfig):
    """GPTDatasetConfig plus the FIM settings; the token strings are looked up in the tokenizer here, so a
    missing one fails when the config is made, before any index is built."""

    fim_rate: Optional[float] = None
    """Probability that a document is rewritten into FIM order (--fim-rate)."""
    fim_spm_rate: Optional[float] = None
    """Probability that a rewritten piece uses the SPM layout rather than PSM (--fim-spm-rate)."""
    fim_extra_tokens: Optional[Dict[str, str]] = None
    """Token strings of the keys prefix, middle, suffix, pad and eod (--fim-*-token)."""
    fim_split_sample: Optional[str] = None
    """A token that cuts a document into fragments rewritten one by one (--fim-split-sample)."""
    fim_fragment_rate: Optional[float] = None
    """Probability that each fragment is rewritten, when the document is (--fim-fragment-rate)."""
    fim_no_prefix: Optional[str] = None
    """Pieces whose text starts with this string are left as they are (--fim-no-prefix)."""
    fim_token_ids: Optional[FIMTokenIds] = field(init=False, default=None)

    def __post_init__(self):
        super().__post_init__()
        for flag, rate in (("--fim-rate", self.fim_rate), ("--fim-spm-rate", self.fim_spm_rate)):
            _check_rate(flag, rate)
        if self.fim_fragment_rate is not None:
            _check_rate("--fim-fragment-rate", self.fim_fragment_rate)
        elif self.fim_split_sample is not None:
            raise ValueError("--fim-split-sample rewrites fragments with --fim-fragment-rate: pass it too")
        tokens = self.fim_extra_tokens or {}
        missing = [key for key in TOKEN_FLAGS if tokens.get(key) is None]
        if missing:
            raise ValueError(f"GPTFIMDatasetConfig.fim_extra_tokens needs the keys {', '.join(TOKEN_FLAGS)}; "
                             f"missing: {', '.join(missing)}")
        ids = {key: token_id(self.tokenizer, tokens[key], flag) for key, flag in TOKEN_FLAGS.items()}
        if self.fim_split_sample is not None:
            ids["split"] = token_id(self.tokenizer, self.fim_split_sample, "--fim-split-sample")
        self.fim_token_ids = FIMTokenIds(**ids)


def _check_rate(flag: str, rate) -> None:
    if rate is None or not 0.0 <= rate <= 1.0:
        raise ValueError(f"{flag} ({rate}) must be a probability in [0, 1]")


def token_id(tokenizer, token: str, flag: str) -> int:
    """The id of `token` in the tokenizer's vocabulary (str keys, or bytes keys as tiktoken's), else a
    one-line error naming `flag`: FIM needs each special token to be a single token of the vocabulary."""
    try:
        vocab = tokenizer.vocab
    except NotImplementedError as e:
        raise ValueError(f"{flag} {token!r} cannot be looked up: {e}; --fim-data needs a tokenizer with a "
                         "vocabulary holding the FIM tokens (e.g. --tokenizer-type HuggingFaceTokenizer)") from None
    for key in (token, token.encode("utf-8")):
        if key in vocab:
            return int(vocab[key])
    raise ValueError(f"{flag} {token!r} is not in the tokenizer's vocabulary: add it to the tokenizer as a special "
                     f"token (tokenizer.json's added_tokens) or pass {flag} with a token the tokenizer has")


class GPTFIMDataset(GPTDataset):
    """GPTDataset whose samples are rewritten into fill-in-the-middle order (same length, same order)."""

    def __init__(self, indexed_dataset, dataset_path: Optional[str], indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split, config: GPTFIMDatasetConfig):
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.permuter = FIMPermuter(config.tokenizer, config.fim_token_ids, config.fim_rate, config.fim_spm_rate,
                                    config.fim_fragment_rate, config.fim_no_prefix)
        # Separates the random streams of blended prefixes and of the three splits.
        self._rng_salt = zlib.crc32(f"{dataset_path}|{index_split.name}".encode("utf-8"))

    def _sample_text(self, idx: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
        text, document_ids = super()._sample_text(idx)
        rng = numpy.random.RandomState([self.config.random_seed % 2 ** 32, self._rng_salt, int(idx)])
        return self.permuter(text, rng), document_ids
