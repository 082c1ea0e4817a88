"""Abstract tokenizer interface the datasets rely on (`eod`, `pad`, `unique_identifiers`, ...)."""
import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any

import numpy


class MegatronTokenizer(ABC):
    """Base class for tokenizers; `unique_identifiers` goes into dataset cache hashes."""

    def __init__(self, *tokenizer_paths: str, **tokenizer_options: Any):
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(tokenizer_paths)
        for option in tokenizer_options:
            self.unique_identifiers[option] = str(tokenizer_options[option])
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        super().__init__()

    @abstractmethod
    def tokenize(self, text: str) -> numpy.ndarray:
        pass

    def detokenize(self, ids: numpy.ndarray) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no detokenizer")

    def offsets(self, ids, text):
        raise NotImplementedError(f"{type(self).__name__} has no offsets")

    @property
    @abstractmethod
    def vocab(self):
        pass

    @property
    @abstractmethod
    def inv_vocab(self):
        pass

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        pass

    def _missing(self, name):
        raise NotImplementedError(f"{type(self).__name__} has no {name} token")

    @property
    def cls(self):
        self._missing("cls")

    @property
    def sep(self):
        self._missing("sep")

    @property
    def pad(self):
        self._missing("pad")

    @property
    def eod(self):
        self._missing("eod")

    @property
    def bos(self):
        self._missing("bos")

    @property
    def eos(self):
        self._missing("eos")

    @property
    def mask(self):
        self._missing("mask")
