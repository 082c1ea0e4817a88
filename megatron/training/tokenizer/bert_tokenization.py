"""WordPiece tokenizer from a BERT vocab.txt (lower-case or cased), via the `tokenizers` library."""
from megatron.training.tokenizer.vocab_tokenizer import _TokenizersLibTokenizer


class _BertWordPieceTokenizer(_TokenizersLibTokenizer):
    """BERT WordPiece; the cased variant registers <extra_id_0..99> for T5 like Megatron does."""

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0):
        super().__init__(vocab_file, lower_case=lower_case, vocab_extra_ids=vocab_extra_ids)
        from tokenizers import BertWordPieceTokenizer  # lazy: ~30 ms to import, BERT WordPiece only

        tok = BertWordPieceTokenizer(vocab_file, lowercase=lower_case, strip_accents=lower_case)
        if not lower_case and vocab_extra_ids == 0:
            vocab_extra_ids = 100
        tok.add_special_tokens(["[BOS]", "[EOS]"])
        self._setup(tok, vocab_extra_ids)

    def decode_token_ids(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def detokenize(self, ids) -> str:
        return self.decode_token_ids(ids)

    cls = property(lambda self: self._vocab["[CLS]"])
    sep = property(lambda self: self._vocab["[SEP]"])
    pad = property(lambda self: self._vocab["[PAD]"])
    mask = property(lambda self: self._vocab["[MASK]"])
    bos = property(lambda self: self._vocab["[BOS]"])
    eos = property(lambda self: self._vocab["[EOS]"])
    eod = property(lambda self: self._vocab["[SEP]"])
