"""Byte-level BPE family: GPT-2 vocab.json+merges.txt, HuggingFace tokenizer.json, tiktoken, and Null."""
import base64
import json
import os
from typing import List, Optional

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.training.tokenizer.vocab_tokenizer import _TokenizersLibTokenizer

_EOD = "<|endoftext|>"


class _TokenizersBackedTokenizer(_TokenizersLibTokenizer):
    """Byte-level BPE over a `tokenizers.Tokenizer`: specials survive decoding; offsets into the text."""

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def offsets(self, ids, text):
        return [start for start, _ in self._tok.encode(text, add_special_tokens=False).offsets]


class _GPT2BPETokenizer(_TokenizersBackedTokenizer):
    """GPT-2 byte-level BPE from vocab.json + merges.txt; EOD = <|endoftext|>."""

    def __init__(self, vocab_file: str, merge_file: str, vocab_extra_ids: int = 0):
        super().__init__(vocab_file, merge_file)
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # lazy: ~30 ms, GPT-2 BPE only

        tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        with open(vocab_file, encoding="utf-8") as f:
            if _EOD not in json.load(f):
                raise ValueError(f"--vocab-file {vocab_file}: no {_EOD} token; GPT2BPETokenizer needs it as EOD")
        tok.add_special_tokens([_EOD])
        self._setup(tok, vocab_extra_ids)
        self.eod_id = self._vocab[_EOD]

    @property
    def eod(self):
        return self.eod_id

    @property
    def eos(self):
        return self.eod_id

    @property
    def bos(self):
        return self.eod_id


class _HuggingFaceTokenizer(_TokenizersBackedTokenizer):
    """A local tokenizer.json (file or directory holding one); never downloads."""

    def __init__(self, pretrained_model_name_or_path: str, vocab_extra_ids: int = 0, **kwargs):
        super().__init__(pretrained_model_name_or_path, **kwargs)
        from tokenizers import Tokenizer  # lazy: ~30 ms to import, HuggingFaceTokenizer only

        path = pretrained_model_name_or_path
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"--tokenizer-model {pretrained_model_name_or_path}: no tokenizer.json found; "
                             "HuggingFaceTokenizer loads local files only")
        self._setup(Tokenizer.from_file(path), vocab_extra_ids)
        self._special = {}
        config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
            for key in ("eos_token", "bos_token", "pad_token", "unk_token", "cls_token", "sep_token", "mask_token"):
                token = config.get(key)
                if isinstance(token, dict):
                    token = token.get("content")
                if token in self._vocab:
                    self._special[key] = self._vocab[token]
        if "eos_token" not in self._special:
            for name in (_EOD, "</s>", "<|end_of_text|>", "<eos>"):
                if name in self._vocab:
                    self._special["eos_token"] = self._vocab[name]
                    break

    def _get(self, key):
        if key not in self._special:
            self._missing(key.replace("_token", ""))
        return self._special[key]

    eod = property(lambda self: self._get("eos_token"))
    eos = property(lambda self: self._get("eos_token"))
    bos = property(lambda self: self._get("bos_token"))
    pad = property(lambda self: self._special.get("pad_token"))
    cls = property(lambda self: self._get("cls_token"))
    sep = property(lambda self: self._get("sep_token"))
    mask = property(lambda self: self._get("mask_token"))


_TIKTOKEN_PATTERNS = {
    "v1": r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "v2": r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"""
          r"""[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"""
          r"""\s+(?!\S)|\s+""",
}
_TIKTOKEN_DEFAULT_SPECIALS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]


class _TikTokenizer(MegatronTokenizer):
    """tiktoken BPE from a local file; the first `num_special_tokens` ids are reserved for specials."""

    def __init__(self, path: str, pattern: str = "v2", vocab_size: Optional[int] = None,
                 num_special_tokens: int = 1000, special_tokens: Optional[List[str]] = None):
        super().__init__(path, pattern=pattern, vocab_size=vocab_size, num_special_tokens=num_special_tokens,
                         special_tokens=special_tokens)
        import tiktoken  # lazy: ~13 ms to import, TikTokenizer only

        if pattern not in _TIKTOKEN_PATTERNS:
            raise ValueError(f"--tiktoken-pattern {pattern}: choose v1 or v2")
        specials = list(special_tokens or _TIKTOKEN_DEFAULT_SPECIALS)
        if len(specials) > num_special_tokens:
            raise ValueError("--tiktoken-special-tokens: more tokens than --tiktoken-num-special-tokens")
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        ranks = self._load_ranks(path)
        if vocab_size is not None:
            ranks = {k: v for k, v in ranks.items() if v < vocab_size - num_special_tokens}
        self._specials = specials
        self._enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=_TIKTOKEN_PATTERNS[pattern],
                                      mergeable_ranks={k: v + num_special_tokens for k, v in ranks.items()},
                                      special_tokens={t: i for i, t in enumerate(specials)})
        self._num_special = num_special_tokens
        self._vocab_size = len(ranks) + num_special_tokens

    @staticmethod
    def _load_ranks(path):
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                return {base64.b64decode(e["token_bytes"]): e["rank"] for e in json.load(f)}
        ranks = {}
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        return ranks

    def tokenize(self, text: str) -> List[int]:
        return self._enc.encode(text, disallowed_special=())

    def detokenize(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    @property
    def vocab(self):
        return {self._enc.decode_single_token_bytes(i): i for i in range(self._num_special, self._vocab_size)}

    @property
    def inv_vocab(self):
        return {v: k for k, v in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _special(self, name):
        return self._specials.index(name) if name in self._specials else self._missing(name)

    eod = property(lambda self: self._special("</s>"))
    eos = property(lambda self: self._special("</s>"))
    bos = property(lambda self: self._special("<s>"))
    pad = property(lambda self: self._special("<pad>"))
    unk = property(lambda self: self._special("<unk>"))
    mask = property(lambda self: self._special("<mask>"))
    cls = property(lambda self: self._special("<cls>"))
    sep = property(lambda self: self._special("<sep>"))


class _NullTokenizer(MegatronTokenizer):
    """Ids are the whitespace-separated integers of the text; eod = vocab_size - 1 and no pad id (-1) unless given
    (--null-tokenizer-eod-id / --null-tokenizer-pad-id, Megatron HEAD)."""

    def __init__(self, vocab_size, eod_id=None, pad_id=-1):
        super().__init__(None, vocab_size=vocab_size)
        self._vocab_size_without_eod = int(vocab_size) - 1
        self._eod_id = self._vocab_size_without_eod if eod_id is None else int(eod_id)
        self._pad_id = int(pad_id)
        for name, value in (("--null-tokenizer-eod-id", eod_id), ("--null-tokenizer-pad-id", pad_id)):
            if value is not None and value != -1 and not 0 <= int(value) < int(vocab_size):
                raise ValueError(f"{name} {value} is outside the vocabulary (0..{int(vocab_size) - 1})")

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(x)) for x in ids)

    def offsets(self, ids, text):
        offsets, start = [], 0
        for token in text.split():
            start = text.index(token, start)
            offsets.append(start)
            start += len(token)
        return offsets

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary")

    @property
    def inv_vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary")

    @property
    def eod(self):
        return self._eod_id

    @property
    def pad(self):
        return self._pad_id

    @property
    def additional_special_tokens_ids(self):
        return None
