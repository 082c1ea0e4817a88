"""--fim-data: the PSM/SPM rewrite restores the original when undone, rates 0 and 1 do nothing and everything,
fragments and --fim-no-prefix behave as in Megatron-LM, samples keep their length and depend only on the seed;
pretrain_gpt.py's dataset provider yields FIM samples through a Hugging Face tokenizer; missing FIM tokens
fail in one line naming the flag."""
import os
import types

import numpy
import pytest

import pretrain_gpt
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
from megatron.training.datasets.fim_dataset import GPTFIMDatasetConfig
from megatron.training.datasets.fim_permute import FIMPermuter, FIMTokenIds
from megatron.training.tokenizer.tokenizer import _NullTokenizer, build_tokenizer
from tests.fixtures.tiny_gpt import single_rank

EOD, PRE, MID, SUF, PAD, SEP = 1000, 1001, 1002, 1003, 1004, 1005
IDS = FIMTokenIds(prefix=PRE, middle=MID, suffix=SUF, pad=PAD, eod=EOD)
SPECIALS = {"<|endoftext|>": EOD, "<fim_prefix>": PRE, "<fim_middle>": MID, "<fim_suffix>": SUF,
            "<fim_pad>": PAD, "<file_sep>": SEP}


class CharTokenizer:
    """One token per character (id = code point) and the FIM tokens above 1000: text cut anywhere
    tokenizes back to the same ids, so an undone rewrite must give the original tokens exactly."""

    vocab = {**{chr(i): i for i in range(32, 127)}, **SPECIALS}

    def tokenize(self, text):
        return [ord(c) for c in text]

    def detokenize(self, ids):
        return "".join(chr(int(i)) for i in ids)


def _ids(text):
    return numpy.array([ord(c) for c in text], dtype=numpy.int64)


def _permuter(rate=1.0, spm_rate=0.5, split=None, fragment_rate=None, no_prefix=None):
    ids = FIMTokenIds(**{**IDS.__dict__, "split": split})
    return FIMPermuter(CharTokenizer(), ids, rate, spm_rate, fragment_rate, no_prefix)


def _undo(piece, pre=PRE, mid=MID, suf=SUF):
    """The original tokens of one rewritten piece: PSM <P> p <S> s <M> m and SPM <P> <S> s <M> p m."""
    piece = list(piece)
    assert piece[0] == pre
    m = piece.index(mid)
    if piece[1] == suf:  # SPM (or PSM with an empty prefix): prefix and middle follow <M> in order
        return piece[m + 1:] + piece[2:m]
    s = piece.index(suf)
    return piece[1:s] + piece[m + 1:] + piece[s + 1:m]


DOC = _ids("def add(a, b):\n    return a + b\n")


@pytest.mark.parametrize("spm_rate", [0.0, 1.0])
def test_psm_and_spm_layouts_give_back_the_original(spm_rate):
    permuter = _permuter(spm_rate=spm_rate)
    for seed in range(40):
        out = permuter.permute(DOC, 1.0, numpy.random.RandomState(seed))
        assert len(out) == len(DOC) + 3
        if spm_rate:
            assert out[:2].tolist() == [PRE, SUF]
        else:
            s, m = out.tolist().index(SUF), out.tolist().index(MID)
            assert out[0] == PRE and s < m and out[1:s].tolist() == DOC[:s - 1].tolist()  # <P> prefix <S>
        assert _undo(out) == DOC.tolist()


def test_rate_zero_leaves_samples_unchanged():
    # leading, doubled and trailing EODs stay where they are
    sample = numpy.concatenate([[EOD], DOC, [EOD, EOD], _ids("x = 1"), [EOD]])
    for seed in range(10):
        assert numpy.array_equal(_permuter(rate=0.0)(sample, numpy.random.RandomState(seed)), sample)


def test_rate_one_rewrites_every_document_and_keeps_the_length():
    docs = [_ids("alpha beta"), _ids("gamma"), _ids("delta epsilon zeta")]
    sample = numpy.concatenate([docs[0], [EOD], docs[1], [EOD], docs[2]])
    for seed in range(20):
        out = _permuter(rate=1.0)(sample, numpy.random.RandomState(seed))
        assert len(out) == len(sample)
        pieces = numpy.split(out, numpy.flatnonzero(out == EOD))
        # every document starts with <prefix>; the 6 sentinels push the last document's end off the sample
        assert [p[p != EOD][0] for p in pieces] == [PRE] * 3
        assert _undo(pieces[0]) == docs[0].tolist() and _undo(pieces[1][1:]) == docs[1].tolist()


def test_a_shorter_rewrite_is_padded_with_the_fim_pad_token():
    # five sentinels inside the data are dropped from the text: 5 fewer tokens, 3 sentinels more
    sample = numpy.concatenate([_ids("abc"), [MID] * 5, _ids("def")])
    out = _permuter(rate=1.0)(sample, numpy.random.RandomState(0))
    assert len(out) == len(sample) and out[-2:].tolist() == [PAD, PAD] and PAD not in out[:-2]


def test_split_sample_rewrites_fragments_with_the_fragment_rate():
    fragments = [_ids("import os"), _ids("print(1)"), _ids("x = 2")]
    doc = numpy.concatenate([fragments[0], [SEP], fragments[1], [SEP], fragments[2]])
    every = _permuter(rate=1.0, split=SEP, fragment_rate=1.0)
    for seed in range(10):
        # a second document takes the 9 tokens the sentinels add
        out = every(numpy.concatenate([doc, [EOD], _ids("y" * 20)]), numpy.random.RandomState(seed))
        first = out[:out.tolist().index(EOD)]
        pieces = numpy.split(first, numpy.flatnonzero(first == SEP))
        assert [p[p != SEP][0] for p in pieces] == [PRE] * 3  # the separators stay, each fragment rewritten
        assert [_undo(p[p != SEP]) for p in pieces] == [f.tolist() for f in fragments]
    rng = numpy.random.RandomState(0)
    assert numpy.array_equal(_permuter(rate=1.0, split=SEP, fragment_rate=0.0)(doc, rng), doc)
    assert numpy.array_equal(_permuter(rate=0.0, split=SEP, fragment_rate=1.0)(doc, rng), doc)
    # a document without the split token is rewritten whole, with --fim-rate
    plain = _permuter(rate=1.0, split=SEP, fragment_rate=0.0)(numpy.concatenate([DOC, [EOD]]), rng)
    assert plain[0] == PRE


def test_no_prefix_skips_documents_that_start_with_it():
    skipped, rewritten = _ids("#!skip me"), _ids("keep me")
    sample = numpy.concatenate([skipped, [EOD], rewritten, [EOD]])
    out = _permuter(rate=1.0, no_prefix="#!")(sample, numpy.random.RandomState(0))
    assert numpy.array_equal(out[:len(skipped) + 1], sample[:len(skipped) + 1])
    assert out[len(skipped) + 1] == PRE


def test_the_rewrite_is_a_function_of_the_seed():
    sample = numpy.concatenate([DOC, [EOD], DOC])
    permuter = _permuter(rate=0.5)
    runs = [[permuter(sample, numpy.random.RandomState(seed)) for seed in range(30)] for _ in range(2)]
    assert all(numpy.array_equal(a, b) for a, b in zip(*runs))
    assert len({tuple(out) for out in runs[0]}) > 10


def _config(tokenizer, **tokens):
    extra = {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>", "pad": "<fim_pad>",
             "eod": "<|endoftext|>", **tokens}
    return GPTFIMDatasetConfig(random_seed=1, sequence_length=16, blend=None, split="1,0,0", tokenizer=tokenizer,
                               reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                               fim_rate=0.5, fim_spm_rate=0.5, fim_extra_tokens=extra)


def test_fim_tokens_missing_from_the_vocabulary_are_named_in_one_line():
    tokenizer = types.SimpleNamespace(vocab=dict(CharTokenizer.vocab), eod=EOD, pad=None,
                                      unique_identifiers={"class": "char"})
    assert _config(tokenizer).fim_token_ids == IDS
    with pytest.raises(ValueError, match=r"^--fim-middle-token '<mid>' is not in the tokenizer's vocabulary: "):
        _config(tokenizer, middle="<mid>")
    with pytest.raises(ValueError, match=r"^--fim-prefix-token '<fim_prefix>' cannot be looked up: NullTokenizer "
                                         r"has no vocabulary; --fim-data needs a tokenizer with a vocabulary"):
        _config(_NullTokenizer(vocab_size=64))


# --- pretrain_gpt.py's provider, a Hugging Face tokenizer and a .bin/.idx prefix ---

def _write_tokenizer(directory):
    """A byte-level tokenizer.json (one token per byte, no merges) with EOD and the FIM tokens added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # lazy: optional dependency (importorskip)

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    return tok


def test_pretrain_gpt_provider_builds_fim_samples(tmp_path):
    pytest.importorskip("tokenizers")
    tok = _write_tokenizer(str(tmp_path / "tok"))
    eod = tok.token_to_id("<|endoftext|>")
    builder = IndexedDatasetBuilder(str(tmp_path / "code.bin"), dtype=numpy.uint16)
    for i in range(40):
        text = f"def f{i}(x):\n    return x * {i} + {i % 7}\n"
        builder.add_item(numpy.array(tok.encode(text).ids + [eod]))
        builder.end_document()
    builder.finalize(str(tmp_path / "code.idx"))
    argv = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
            f"--micro-batch-size 1 --global-batch-size 1 --train-iters 8 --lr 1e-3 --tokenizer-type "
            f"HuggingFaceTokenizer --tokenizer-model {tmp_path / 'tok'} --data-path {tmp_path / 'code'} "
            f"--split 100,0,0 --data-cache-path {tmp_path / 'cache'} --fim-data --fim-rate 1 --fim-spm-rate 0")
    single_rank()
    saved = global_vars._GLOBAL_ARGS, global_vars._GLOBAL_TOKENIZER
    try:
        args = validate_args(parse_args(argv=argv.split()))
        global_vars._GLOBAL_ARGS, global_vars._GLOBAL_TOKENIZER = args, build_tokenizer(args)
        train, _, _ = pretrain_gpt.train_valid_test_datasets_provider([8, 0, 0])
    finally:
        global_vars._GLOBAL_ARGS, global_vars._GLOBAL_TOKENIZER = saved
    prefix, middle, suffix = (tok.token_to_id(t) for t in ("<fim_prefix>", "<fim_middle>", "<fim_suffix>"))
    for i in range(8):
        sample = train[i]
        tokens = sample["tokens"].tolist() + sample["labels"][-1:].tolist()
        assert len(tokens) == 65
        starts = [0] + [k + 1 for k, t in enumerate(tokens[:-1]) if t == eod]
        assert all(tokens[k] == prefix for k in starts if tokens[k] != eod)  # each document: a PSM layout
        assert prefix in tokens and suffix in tokens and middle in tokens
        # the same sample as GPTDataset's, rewritten: its first document comes back when undone
        original = GPTDataset._sample_text(train, i)[0].tolist()
        if tokens[0] != eod and eod in tokens:
            assert _undo(tokens[:tokens.index(eod)], prefix, middle, suffix) == original[:original.index(eod)]
