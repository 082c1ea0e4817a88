"""WordPiece tokenizer from a BERT vocab.txt (lower-case or cased), via the `tokenizers` library."""
from typing import List

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer


class _BertWordPieceTokenizer(MegatronTokenizer):
    """BERT WordPiece; the cased variant registers <extra_id_0..99> for T5 like Megatron does."""

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0):
        super().__init__(vocab_file, lower_case=lower_case, vocab_extra_ids=vocab_extra_ids)
        from tokenizers import BertWordPieceTokenizer

        self._tok = BertWordPieceTokenizer(vocab_file, lowercase=lower_case, strip_accents=lower_case)
        if not lower_case and vocab_extra_ids == 0:
            vocab_extra_ids = 100
        specials = ["[BOS]", "[EOS]"] + [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        self._tok.add_special_tokens(specials)
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        self._inv_vocab = {v: k for k, v in self._vocab.items()}
        self._extra_ids = [self._vocab[f"<extra_id_{i}>"] for i in range(vocab_extra_ids)]

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode_token_ids(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def detokenize(self, ids) -> str:
        return self.decode_token_ids(ids)

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    cls = property(lambda self: self._vocab["[CLS]"])
    sep = property(lambda self: self._vocab["[SEP]"])
    pad = property(lambda self: self._vocab["[PAD]"])
    mask = property(lambda self: self._vocab["[MASK]"])
    bos = property(lambda self: self._vocab["[BOS]"])
    eos = property(lambda self: self._vocab["[EOS]"])
    eod = property(lambda self: self._vocab["[SEP]"])
    additional_special_tokens_ids = property(lambda self: self._extra_ids)
