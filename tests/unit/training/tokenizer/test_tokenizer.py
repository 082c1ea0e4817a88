"""Tokenizers round-trip and pad the vocab with Megatron's log line: GPT-2 BPE, Null, HuggingFace."""
from types import SimpleNamespace

import pytest

from megatron.training.tokenizer.tokenizer import _NullTokenizer, build_tokenizer


def test_gpt2_bpe_tokenizer_and_padding(capsys):
    args = SimpleNamespace(tokenizer_type="GPT2BPETokenizer", vocab_file="data/vocab.json",
                           merge_file="data/merges.txt", make_vocab_size_divisible_by=128,
                           tensor_model_parallel_size=3, rank=0, vocab_extra_ids=0)
    tok = build_tokenizer(args)
    text = "Return a new sorted list from the items in iterable.\n"
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.eod == tok.vocab["<|endoftext|>"]
    assert args.padded_vocab_size == 8448  # ceil(8192 / 384) * 384
    assert "> padded vocab (size: 8192) with 256 dummy tokens (new size: 8448)" in capsys.readouterr().out


def test_null_and_huggingface_tokenizers(tmp_path):
    null = _NullTokenizer(vocab_size=64)
    assert null.tokenize("1 2 3") == [1, 2, 3] and null.eod == 63 and null.vocab_size == 64
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2, "</s>": 3}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    args = SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path),
                           make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, rank=1)
    tok = build_tokenizer(args)
    assert tok.tokenize("hello world") == [0, 1] and tok.eod == 3
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer(SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="no/such/dir"))
    with pytest.raises(ValueError, match="--tokenizer-type"):
        build_tokenizer(SimpleNamespace(tokenizer_type="Nope"))
