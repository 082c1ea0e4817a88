"""`--tokenizer-type` chooser and vocab padding (COMPAT.md 5). Every tokenizer reads local files only."""
import math
import os

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.training.tokenizer.bert_tokenization import _BertWordPieceTokenizer
from megatron.training.tokenizer.bpe_tokenizers import (
    _GPT2BPETokenizer,
    _HuggingFaceTokenizer,
    _NullTokenizer,
    _TikTokenizer,
)
from megatron.training.tokenizer.sentencepiece_tokenizers import (
    _GPTSentencePieceTokenizer,
    _Llama2Tokenizer,
    _SentencePieceTokenizer,
)

__all__ = ["build_tokenizer", "MegatronTokenizer", "_GPT2BPETokenizer", "_HuggingFaceTokenizer", "_NullTokenizer",
           "_TikTokenizer", "_SentencePieceTokenizer", "_GPTSentencePieceTokenizer", "_Llama2Tokenizer",
           "_BertWordPieceTokenizer", "_vocab_size_with_padding"]


def _need(args, name, flag, tokenizer_type):
    value = getattr(args, name, None)
    if value is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if name != "vocab_size" and not os.path.exists(value):
        raise ValueError(f"{flag} {value}: file not found (tokenizers are loaded from local files only)")
    return value


def build_tokenizer(args, **kwargs):
    """Build the tokenizer named by args.tokenizer_type and set args.padded_vocab_size. Megatron's API: tools
    (tools/preprocess_data.py) pass their own namespaces, so flags they lack read as their defaults."""
    kind = getattr(args, "tokenizer_type", None)
    if getattr(args, "rank", 0) == 0:
        print(f"> building {kind} tokenizer ...", flush=True)
    extra_ids = getattr(args, "vocab_extra_ids", 0) or 0
    if kind == "BertWordPieceLowerCase":
        tokenizer = _BertWordPieceTokenizer(_need(args, "vocab_file", "--vocab-file", kind), lower_case=True,
                                            vocab_extra_ids=extra_ids)
    elif kind == "BertWordPieceCase":
        tokenizer = _BertWordPieceTokenizer(_need(args, "vocab_file", "--vocab-file", kind), lower_case=False,
                                            vocab_extra_ids=extra_ids)
    elif kind == "GPT2BPETokenizer":
        tokenizer = _GPT2BPETokenizer(_need(args, "vocab_file", "--vocab-file", kind),
                                      _need(args, "merge_file", "--merge-file", kind), vocab_extra_ids=extra_ids)
    elif kind == "SentencePieceTokenizer":
        tokenizer = _SentencePieceTokenizer(_need(args, "tokenizer_model", "--tokenizer-model", kind),
                                            vocab_extra_ids=extra_ids)
    elif kind == "GPTSentencePieceTokenizer":
        tokenizer = _GPTSentencePieceTokenizer(_need(args, "tokenizer_model", "--tokenizer-model", kind))
    elif kind == "Llama2Tokenizer":
        tokenizer = _Llama2Tokenizer(_need(args, "tokenizer_model", "--tokenizer-model", kind))
    elif kind in ("HuggingFaceTokenizer", "SFTTokenizer"):  # SFTTokenizer: --sft renders chats from the same dir
        tokenizer = _HuggingFaceTokenizer(_need(args, "tokenizer_model", "--tokenizer-model", kind),
                                          vocab_extra_ids=extra_ids)
    elif kind == "TikTokenizer":
        tokenizer = _TikTokenizer(_need(args, "tokenizer_model", "--tokenizer-model", kind),
                                  pattern=getattr(args, "tiktoken_pattern", None) or "v2",
                                  num_special_tokens=getattr(args, "tiktoken_num_special_tokens", 1000) or 1000,
                                  special_tokens=getattr(args, "tiktoken_special_tokens", None))
    elif kind == "NullTokenizer":
        tokenizer = _NullTokenizer(_need(args, "vocab_size", "--vocab-size", kind),
                                   eod_id=getattr(args, "null_tokenizer_eod_id", None),
                                   pad_id=getattr(args, "null_tokenizer_pad_id", -1))
    else:
        raise ValueError(f"--tokenizer-type {kind!r} is not supported; choose one of GPT2BPETokenizer, "
                         "HuggingFaceTokenizer, SFTTokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, "
                         "Llama2Tokenizer, TikTokenizer, NullTokenizer, BertWordPieceLowerCase, BertWordPieceCase")
    requested = getattr(args, "requested_padded_vocab_size", None)
    if requested is not None:  # --padded-vocab-size: the model's vocabulary as given
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        if requested < tokenizer.vocab_size or requested % tp:
            raise ValueError(f"--padded-vocab-size {requested} must be >= the tokenizer's vocabulary "
                             f"({tokenizer.vocab_size}) and divisible by --tensor-model-parallel-size ({tp})")
        args.padded_vocab_size = requested
    elif getattr(args, "padded_vocab_size", None) is None or kwargs.get("force_padding", True):
        args.padded_vocab_size = _vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer


def _vocab_size_with_padding(orig_vocab_size, args, logging_enabled=True):
    """Pad the vocab to a multiple of make_vocab_size_divisible_by * TP (so it splits evenly)."""
    multiple = (getattr(args, "make_vocab_size_divisible_by", 128) or 1) * \
        (getattr(args, "tensor_model_parallel_size", 1) or 1)
    after = int(math.ceil(orig_vocab_size / multiple) * multiple)
    if logging_enabled and getattr(args, "rank", 0) == 0:
        print(" > padded vocab (size: {}) with {} dummy tokens (new size: {})".format(
            orig_vocab_size, after - orig_vocab_size, after), flush=True)
    return after
