"""Shared bases for tokenizers that keep their vocabulary as Python dicts."""
from typing import List

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer


class _DictVocabTokenizer(MegatronTokenizer):
    """Serves ``vocab`` / ``inv_vocab`` / ``vocab_size`` from ``self._vocab`` (token -> id) and
    ``self._inv_vocab`` (id -> token), which the subclass fills in its constructor."""

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)


class _TokenizersLibTokenizer(_DictVocabTokenizer):
    """Wraps a ``tokenizers.Tokenizer``: registers <extra_id_N> tokens (T5 sentinels) and reads the vocab."""

    def _setup(self, tok, vocab_extra_ids: int):
        self._tok = tok
        if vocab_extra_ids:
            tok.add_special_tokens([f"<extra_id_{i}>" for i in range(vocab_extra_ids)])
        self._vocab = tok.get_vocab(with_added_tokens=True)
        self._inv_vocab = {v: k for k, v in self._vocab.items()}
        self._extra_ids = [self._vocab[f"<extra_id_{i}>"] for i in range(vocab_extra_ids)]

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    @property
    def additional_special_tokens_ids(self):
        return self._extra_ids
