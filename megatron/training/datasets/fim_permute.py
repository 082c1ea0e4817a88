"""Fill-in-the-middle (FIM) rewriting of one GPT sample, with Megatron-LM's layouts and random draws.

A document d is cut at two random *character* positions into prefix, middle and suffix (the cut falls
anywhere in the text, also inside a token, so the model learns to complete partial words), each piece is
tokenized again and the pieces are reordered around the sentinel tokens (Bavarian et al. 2022):

    PSM:  <prefix> prefix <suffix> suffix <middle> middle
    SPM:  <prefix> <suffix> suffix <middle> prefix middle      (Megatron's SPM variant)

so that the middle is predicted after seeing both sides. Samples hold several documents: the sample is cut
at every EOD token and each document is rewritten on its own. With a split token (--fim-split-sample, e.g. a
file separator in a repository-level document), a document chosen for FIM is cut again at that token and
each fragment is rewritten with the fragment rate. The sentinels make a rewritten sample longer; the sample
is cut back to its length (or padded with the FIM pad token), as in Megatron-LM.

The draws per piece follow Megatron's order: Bernoulli(rate), then two cut points, then Bernoulli(spm_rate).
"""
from dataclasses import dataclass
from typing import Callable, Optional

import numpy


@dataclass(frozen=True)
class FIMTokenIds:
    """Ids of the sentinels, the pad, the document separator and the optional fragment separator."""

    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split: Optional[int] = None


class FIMPermuter:
    """Rewrites token samples into FIM order with a tokenizer that detokenizes and tokenizes text.

    `permuter(tokens, rng)` returns an array of the same length; `rng` (numpy RandomState) makes every draw,
    so one seeded RandomState per sample gives the same rewrite whatever the order samples are read in.
    """

    def __init__(self, tokenizer, ids: FIMTokenIds, rate: float, spm_rate: float,
                 fragment_rate: Optional[float] = None, no_prefix: Optional[str] = None):
        self.tokenizer = tokenizer
        self.ids = ids
        self.rate = rate
        self.spm_rate = spm_rate
        self.fragment_rate = fragment_rate
        self.no_prefix = no_prefix
        # Dropped before detokenizing (Megatron decodes without special tokens): a sentinel already in the
        # data would otherwise come back as text and be cut through.
        self._sentinels = numpy.array([ids.prefix, ids.middle, ids.suffix, ids.pad], dtype=numpy.int64)

    def __call__(self, tokens: numpy.ndarray, rng: numpy.random.RandomState) -> numpy.ndarray:
        tokens = numpy.asarray(tokens, dtype=numpy.int64)
        out = _map_between(tokens, self.ids.eod, lambda document: self._document(document, rng))
        if len(out) >= len(tokens):  # the sentinels' extra tokens fall off the end
            return out[:len(tokens)]
        return numpy.concatenate([out, numpy.full(len(tokens) - len(out), self.ids.pad, dtype=numpy.int64)])

    def _document(self, document: numpy.ndarray, rng) -> numpy.ndarray:
        """One document: whole, or (with a split token present) fragment by fragment."""
        if self.ids.split is None or not (document == self.ids.split).any():
            return self.permute(document, self.rate, rng)
        if not rng.binomial(1, self.rate):
            return document
        return _map_between(document, self.ids.split,
                            lambda fragment: self.permute(fragment, self.fragment_rate, rng))

    def permute(self, piece: numpy.ndarray, rate: float, rng) -> numpy.ndarray:
        """With probability `rate`, `piece` cut at two random characters and laid out as PSM or SPM."""
        if not rng.binomial(1, rate):
            return piece
        text = self.tokenizer.detokenize(piece[~numpy.isin(piece, self._sentinels)])
        if self.no_prefix is not None and text.startswith(self.no_prefix):
            return piece
        # Cuts may be equal or at either end: the prefix, middle or suffix may be empty.
        lo, hi = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (self._encode(text[:lo]), self._encode(text[lo:hi]), self._encode(text[hi:]))
        ids = self.ids
        if rng.binomial(1, self.spm_rate):
            parts = [[ids.prefix, ids.suffix], suffix, [ids.middle], prefix, middle]
        else:
            parts = [[ids.prefix], prefix, [ids.suffix], suffix, [ids.middle], middle]
        return numpy.concatenate([numpy.asarray(p, dtype=numpy.int64) for p in parts])

    def _encode(self, text: str):
        return list(self.tokenizer.tokenize(text)) if text else []


def _map_between(tokens: numpy.ndarray, separator: int, rewrite: Callable) -> numpy.ndarray:
    """`tokens` with every non-empty run between `separator` tokens replaced by `rewrite(run)`; the separators
    stay. (Megatron drops a separator that follows an empty run, e.g. the second of two EODs; kept here, so a
    rate of 0 leaves every sample as it was.)"""
    pieces, start = [], 0
    for cut in numpy.flatnonzero(tokens == separator):
        if cut > start:
            pieces.append(rewrite(tokens[start:cut]))
        pieces.append(tokens[cut:cut + 1])
        start = cut + 1
    if start < len(tokens):
        pieces.append(rewrite(tokens[start:]))
    return numpy.concatenate(pieces) if pieces else tokens
