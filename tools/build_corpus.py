"""Regenerate the shipped corpus and tokenizer under data/.

Corpus: docstrings of the Python standard library (PSF License) collected with `inspect`, one JSON
line per module/class/function docstring, written to data/corpus.jsonl.gz. Tokenizer: byte-level BPE
trained on that corpus with the `tokenizers` library, saved GPT-2 style (data/vocab.json,
data/merges.txt) with <|endoftext|> as EOD. Deterministic for a given Python version.

    python tools/build_corpus.py --output-dir data --vocab-size 8192
"""
import argparse
import gzip
import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import sys
import warnings

# modules with import-time side effects (GUI, browser, interactive) or platform-only ones
_SKIP = {"tests", "unittest.test", "idle_test", "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo",
         "__main__", "pydoc_data", "msvcrt", "winreg", "winsound", "_winapi", "nt", "ensurepip", "venv", "lib2to3",
         "test"}


def _docstrings(module):
    """(qualified name, docstring) for the module and its public classes, functions and methods."""
    seen = set()

    def visit(obj, name, depth):
        doc = inspect.getdoc(obj)
        if doc and id(obj) not in seen:
            seen.add(id(obj))
            yield name, doc
        if depth == 0 or inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                owner = getattr(member, "__module__", None) or module.__name__
                if attr.startswith("_") or owner.lstrip("_").split(".")[0] != module.__name__.split(".")[0]:
                    continue
                if inspect.isclass(member) or inspect.isfunction(member) or inspect.isroutine(member):
                    yield from visit(member, f"{name}.{attr}", depth + 1)

    yield from visit(module, module.__name__, 0)


def _module_names():
    """Top-level stdlib modules plus the submodules of stdlib packages, sorted."""
    names = set()
    for name in sys.stdlib_module_names:
        if name in _SKIP or name.startswith("_"):
            continue
        names.add(name)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            for info in pkgutil.walk_packages(spec.submodule_search_locations, prefix=name + ".",
                                              onerror=lambda _: None):
                if not any(part in _SKIP or part.startswith("_") for part in info.name.split(".")):
                    names.add(info.name)
    return sorted(names)


def build_corpus(path, min_chars=80):
    warnings.simplefilter("ignore")
    docs = 0
    with gzip.GzipFile(path, "wb", mtime=0) as raw, open(os.devnull, "w") as devnull:
        for name in _module_names():
            stdout = sys.stdout
            try:
                sys.stdout = devnull
                module = importlib.import_module(name)
            except BaseException:
                continue
            finally:
                sys.stdout = stdout
            for qualname, doc in _docstrings(module):
                if len(doc) >= min_chars:
                    line = json.dumps({"text": doc, "source": qualname}, ensure_ascii=False)
                    raw.write((line + "\n").encode("utf-8"))
                    docs += 1
    return docs


def train_tokenizer(corpus_path, output_dir, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        with gzip.open(corpus_path, "rt", encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer=trainer)
    tok.model.save(output_dir)  # writes vocab.json and merges.txt


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="data")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    corpus = os.path.join(args.output_dir, "corpus.jsonl.gz")
    docs = build_corpus(corpus)
    train_tokenizer(corpus, args.output_dir, args.vocab_size)
    print(f"wrote {docs} documents to {corpus} and a {args.vocab_size}-token BPE to {args.output_dir}")


if __name__ == "__main__":
    main()
