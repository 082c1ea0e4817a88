"""Build the WordPiece vocabularies shipped in data/ from the shipped corpus.

    python tools/build_bert_vocab.py            # writes data/bert-vocab.txt and data/bert-vocab-cased.txt

`tokenizers` breaks frequency ties in hash order, so a rebuild is equivalent but not byte-identical
(a few dozen rare pieces differ): the shipped files are the reference for tests and examples. The lower-case
vocab goes with --tokenizer-type BertWordPieceLowerCase (BERT), the cased one with BertWordPieceCase (T5).
"""
import argparse
import gzip
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] = id 0, as in Google's BERT vocabs


def corpus_texts(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def build(corpus, output, vocab_size, lowercase):
    from tokenizers import BertWordPieceTokenizer
    tok = BertWordPieceTokenizer(lowercase=lowercase, strip_accents=lowercase)
    tok.train_from_iterator(corpus_texts(corpus), vocab_size=vocab_size, min_frequency=2,
                            special_tokens=SPECIALS, wordpieces_prefix="##", show_progress=False)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    with open(output, "w", encoding="utf-8") as f:
        f.writelines(token + "\n" for token, _ in vocab)
    print(f"wrote {output}: {len(vocab)} tokens")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=os.path.join(ROOT, "data", "corpus.jsonl.gz"))
    p.add_argument("--output-dir", default=os.path.join(ROOT, "data"))
    p.add_argument("--vocab-size", type=int, default=8192)
    args = p.parse_args()
    build(args.corpus, os.path.join(args.output_dir, "bert-vocab.txt"), args.vocab_size, lowercase=True)
    build(args.corpus, os.path.join(args.output_dir, "bert-vocab-cased.txt"), args.vocab_size, lowercase=False)


if __name__ == "__main__":
    main()
