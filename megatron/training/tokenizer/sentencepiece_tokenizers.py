"""SentencePiece-model tokenizers: generic (with Megatron's special tokens), GPT-style and Llama-2."""
from typing import List

from megatron.training.tokenizer.vocab_tokenizer import _DictVocabTokenizer


class _SentencePieceTokenizer(_DictVocabTokenizer):
    """SentencePiece model plus the BERT/T5 specials (<CLS>, <SEP>, <EOD>, <MASK>, <PAD>) and extra ids."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file, vocab_extra_ids=vocab_extra_ids)
        import sentencepiece  # lazy: ~10 ms to import, SentencePiece models only

        self.tokenizer = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self._initialize(vocab_extra_ids)

    def _populate_vocab(self):
        self._vocab, self._inv_vocab = {}, {}
        for i in range(len(self.tokenizer)):
            piece = self.tokenizer.id_to_piece(i)
            self._inv_vocab[i] = piece
            self._vocab[piece] = i

    def _initialize(self, vocab_extra_ids: int):
        self._populate_vocab()
        self._special_tokens, self._inv_special_tokens = {}, {}
        self._t5_tokens = []

        def add(t):
            if t not in self._vocab:
                next_id = len(self._vocab)
                self._vocab[t] = next_id
                self._inv_vocab[next_id] = t
            self._special_tokens[t] = self._vocab[t]
            self._inv_special_tokens[self._vocab[t]] = t

        for name in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            add(name)
        self._cls_id, self._sep_id, self._eod_id, self._mask_id = (self._vocab[n] for n in
                                                                  ("<CLS>", "<SEP>", "<EOD>", "<MASK>"))
        pad_id = self.tokenizer.pad_id()
        add(self.tokenizer.id_to_piece(pad_id) if pad_id >= 0 else "<PAD>")
        self._pad_id = self._vocab[self.tokenizer.id_to_piece(pad_id) if pad_id >= 0 else "<PAD>"]
        bos_id = self.tokenizer.bos_id()
        add(self.tokenizer.id_to_piece(bos_id) if bos_id >= 0 else "<BOS>")
        self._bos_id = self._vocab[self.tokenizer.id_to_piece(bos_id) if bos_id >= 0 else "<BOS>"]
        eos_id = self.tokenizer.eos_id()
        add(self.tokenizer.id_to_piece(eos_id) if eos_id >= 0 else "<EOS>")
        self._eos_id = self._vocab[self.tokenizer.id_to_piece(eos_id) if eos_id >= 0 else "<EOS>"]
        for i in range(vocab_extra_ids):
            t = f"<extra_id_{i}>"
            add(t)
            self._t5_tokens.append(t)

    def tokenize(self, text: str) -> List[int]:
        """Encode, keeping Megatron's added special tokens (e.g. <EOD>) atomic."""
        ids, idx = [], 0
        while idx < len(text):
            hits = [(text.find(t, idx), t) for t in self._special_tokens if text.find(t, idx) >= 0]
            if not hits:
                break
            pos, token = min(hits)
            ids.extend(self.tokenizer.encode_as_ids(text[idx:pos]))
            ids.append(self._special_tokens[token])
            idx = pos + len(token)
        ids.extend(self.tokenizer.encode_as_ids(text[idx:]))
        return ids

    def detokenize(self, ids) -> str:
        text, last = "", 0
        ids = [int(i) for i in ids]
        for i, token in enumerate(ids):
            if token in self._inv_special_tokens:
                text += self.tokenizer.decode_ids(ids[last:i]) + " " + self._inv_special_tokens[token] + " "
                last = i + 1
        return text + self.tokenizer.decode_ids(ids[last:])

    cls = property(lambda self: self._cls_id)
    sep = property(lambda self: self._sep_id)
    pad = property(lambda self: self._pad_id)
    bos = property(lambda self: self._bos_id)
    eod = property(lambda self: self._eod_id)
    eos = property(lambda self: self._eos_id)
    mask = property(lambda self: self._mask_id)

    @property
    def additional_special_tokens_ids(self):
        return [self._vocab[k] for k in self._t5_tokens]


class _GPTSentencePieceTokenizer(_SentencePieceTokenizer):
    """Plain SentencePiece model; EOD = the model's eos id, no added tokens."""

    def __init__(self, model_file: str):
        super().__init__(model_file, vocab_extra_ids=0)

    def _initialize(self, vocab_extra_ids: int):
        self._populate_vocab()
        self._pad_id = self.tokenizer.pad_id()
        self._bos_id = self.tokenizer.bos_id()
        self._eos_id = self.tokenizer.eos_id()
        self._special_tokens, self._inv_special_tokens = {}, {}

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode_ids([int(i) for i in ids])

    cls = property(lambda self: -1)
    sep = property(lambda self: -1)
    mask = property(lambda self: -1)
    eod = property(lambda self: self._eos_id)
    additional_special_tokens_ids = property(lambda self: None)


class _Llama2Tokenizer(_GPTSentencePieceTokenizer):
    """Llama-2 SentencePiece model: BOS is prepended by the user's prompt format, not here."""

    def tokenize(self, text: str, bos: bool = False, eos: bool = False) -> List[int]:
        ids = self.tokenizer.encode_as_ids(text)
        return ([self._bos_id] if bos else []) + ids + ([self._eos_id] if eos else [])
