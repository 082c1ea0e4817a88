"""Tokenize JSON-lines text into Megatron `.bin/.idx` datasets (flags and output names as Megatron-LM).

Streams the input (`.jsonl` or `.jsonl.gz`) in bounded batches, so memory stays flat whatever the
input size; `--workers` processes tokenize in parallel. Output: `{output_prefix}_{key}_{level}.bin/.idx`
with level `document` (or `sentence` with --split-sentences).

    python tools/preprocess_data.py --input data/corpus.jsonl.gz --output-prefix data/processed/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file data/vocab.json --merge-file data/merges.txt \
        --append-eod --workers 2
"""
import argparse
import glob
import gzip
import json
import multiprocessing
import os
import re
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from megatron.training.tokenizer.tokenizer import build_tokenizer  # noqa: E402

_BATCH_LINES = 2048
# a sentence ends at . ! or ? (optionally closed by quotes/brackets) followed by whitespace and a capital,
# digit or opening quote; no model download needed
_SENTENCE_END = re.compile(r"(?<=[.!?])([\"')\]]*)(\s+)(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text, keep_newlines=False):
    """Split English text into sentences; paragraph breaks always end a sentence."""
    sentences = []
    for paragraph in re.split(r"\n\s*\n", text) if not keep_newlines else [text]:
        start = 0
        for match in _SENTENCE_END.finditer(paragraph):
            end = match.end(1) if not keep_newlines else match.end(2)
            sentences.append(paragraph[start:end])
            start = match.end(2)
        sentences.append(paragraph[start:])
    if keep_newlines:
        return [s for s in sentences if s.strip()]
    return [" ".join(s.split()) for s in sentences if s.strip()]


class Encoder:
    """Per-process tokenizer; `encode` turns one JSON line into token ids and sentence lengths per key."""

    tokenizer = None

    def __init__(self, args):
        self.args = args

    def initializer(self):
        Encoder.tokenizer = build_tokenizer(self.args)

    def encode(self, line):
        try:
            data = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return None, f"invalid JSON ({err.msg if hasattr(err, 'msg') else err})", len(line)
        if not isinstance(data, dict):
            return None, "line is not a JSON object", len(line)
        ids, lens = {}, {}
        for key in self.args.json_keys:
            text = data.get(key)
            if not isinstance(text, (str, list)):
                return None, f"missing or non-text key '{key}'", len(line)
            if isinstance(text, list):
                sentences = text
            elif self.args.split_sentences:
                sentences = split_sentences(text, self.args.keep_newlines)
            else:
                sentences = [text]
            doc_ids, sentence_lens = [], []
            for sentence in sentences:
                sentence_ids = Encoder.tokenizer.tokenize(sentence)
                if len(sentence_ids) > 0:  # zero-token sentences are not stored
                    doc_ids.extend(sentence_ids)
                    sentence_lens.append(len(sentence_ids))
            if len(doc_ids) > 0 and self.args.append_eod:
                doc_ids.append(Encoder.tokenizer.eod)
                sentence_lens[-1] += 1
            ids[key], lens[key] = doc_ids, sentence_lens
        return (ids, lens), None, len(line)

    def encode_batch(self, lines):
        return [self.encode(line) for line in lines]


def _open(path):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _batches(path):
    """Yield bounded batches of (line number, raw line); blank lines are ignored."""
    with _open(path) as f:
        batch = []
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            batch.append((lineno, line))
            if len(batch) == _BATCH_LINES:
                yield batch
                batch = []
        if batch:
            yield batch


def _output_prefix(prefix, key, level):
    return f"{prefix}_{key}_{level}"


class Progress:
    def __init__(self, args, total_bytes):
        self.args, self.total_bytes = args, total_bytes
        self.start = time.time()
        self.docs = self.bytes = self.skipped = 0

    def update(self, nbytes):
        self.docs += 1
        self.bytes += nbytes
        if self.docs % self.args.log_interval == 0:
            self.report()

    def report(self):
        elapsed = max(time.time() - self.start, 1e-9)
        pct = f", {100.0 * self.bytes / self.total_bytes:.1f}% of input" if self.total_bytes else ""
        print(f"Processed {self.docs} documents ({self.docs / elapsed:.1f} docs/s, "
              f"{self.bytes / elapsed / 1024 / 1024:.2f} MB/s{pct}).", file=sys.stderr, flush=True)


def process_file(args, input_path, output_prefix, workers):
    """Tokenize one input file into one `.bin/.idx` pair per JSON key; returns (docs, skipped)."""
    encoder = Encoder(args)
    tokenizer = build_tokenizer(args)
    level = "sentence" if args.split_sentences else "document"
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {key: IndexedDatasetBuilder(_output_prefix(output_prefix, key, level) + ".bin", dtype=dtype)
                for key in args.json_keys}
    raw_size = os.path.getsize(input_path) if not input_path.endswith(".gz") else 0
    progress = Progress(args, raw_size)
    try:
        _tokenize(args, input_path, encoder, builders, progress, workers)
        if progress.docs == 0:
            raise SystemExit(f"error: --input {input_path}: no documents (empty input, or every line was skipped "
                             f"or has no text under --json-keys {' '.join(args.json_keys)}); nothing written")
        for key, builder in builders.items():
            builder.finalize(_output_prefix(output_prefix, key, level) + ".idx")
    except BaseException:  # a failed run leaves no half-written dataset behind
        for key, builder in builders.items():
            builder.data_file.close()
            _remove_dataset(_output_prefix(output_prefix, key, level))
        raise
    progress.report()
    if progress.skipped:
        print(f"Skipped {progress.skipped} malformed lines of {input_path}.", file=sys.stderr, flush=True)
    return progress.docs, progress.skipped


def _remove_dataset(prefix):
    for path in (prefix + ".bin", prefix + ".idx"):
        if os.path.exists(path):
            os.remove(path)


def _tokenize(args, input_path, encoder, builders, progress, workers):
    pool = multiprocessing.Pool(workers, initializer=encoder.initializer) if workers > 1 else None
    if pool is None:
        encoder.initializer()
    try:
        pending = None  # overlap: tokenize batch k+1 while writing batch k
        for batch in _batches(input_path):
            lines = [line for _, line in batch]
            if pool is not None:
                job = pool.map_async(encoder.encode_batch, _chunks(lines, max(1, len(lines) // (4 * workers))))
                job = (batch, job)
            else:
                job = (batch, encoder.encode_batch(lines))
            if pending is not None:
                _write(args, input_path, pending, builders, progress)
            pending = job
        if pending is not None:
            _write(args, input_path, pending, builders, progress)
    finally:
        if pool is not None:
            pool.close()
            pool.join()


def _chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


def _write(args, input_path, job, builders, progress):
    batch, result = job
    results = result if isinstance(result, list) else [r for chunk in result.get() for r in chunk]
    for (lineno, _), (encoded, error, nbytes) in zip(batch, results):
        if error is not None:
            message = f"{input_path}:{lineno}: {error}"
            if not args.skip_malformed:
                raise SystemExit(f"error: {message} (pass --skip-malformed to skip and count such lines)")
            print(f"warning: skipping {message}", file=sys.stderr, flush=True)
            progress.skipped += 1
            continue
        ids, lens = encoded
        for key, builder in builders.items():
            builder.add_document(ids[key], lens[key])
        progress.update(nbytes)


def _partition_inputs(args):
    """Input files for each partition: the glob's files if they match --partitions, else a round-robin split."""
    files = sorted(glob.glob(args.input))
    if not files:
        raise SystemExit(f"error: --input {args.input}: no such file")
    if args.partitions == 1:
        if len(files) > 1:
            raise SystemExit("error: --input matches several files; pass --partitions N (one per file) or one file")
        return files
    if len(files) == args.partitions:
        return files
    name, ext = os.path.splitext(files[0])
    if ext == ".gz":
        name, inner = os.path.splitext(name)
        ext = inner + ext
    paths = [f"{name}_{i}{ext}" for i in range(args.partitions)]
    outs = [gzip.open(p, "wb") if ext.endswith(".gz") else open(p, "wb") for p in paths]
    total = None
    if args.keep_sequential_samples:
        total = sum(1 for f in files for _ in _open(f))
    n = 0
    for path in files:
        with _open(path) as f:
            for line in f:
                i = n * args.partitions // total if total else n % args.partitions
                outs[i].write(line)
                n += 1
    for out in outs:
        out.close()
    return paths


def _run_partition(args, path, i):
    process_file(args, path, f"{args.output_prefix}_{i}", args.workers // args.partitions)


def main(argv=None):
    args = get_args(argv)
    level = "sentence" if args.split_sentences else "document"
    if args.partitions == 1:
        files = _partition_inputs(args)
        process_file(args, files[0], args.output_prefix, args.workers)
        return
    paths = _partition_inputs(args)
    try:
        procs = [multiprocessing.Process(target=_run_partition, args=(args, p, i)) for i, p in enumerate(paths)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"error: a partition failed (exit code {p.exitcode}); nothing written")
        tokenizer = build_tokenizer(args)
        for key in args.json_keys:
            out = _output_prefix(args.output_prefix, key, level)
            builder = IndexedDatasetBuilder(out + ".bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
            for i in range(len(paths)):
                builder.add_index(_output_prefix(f"{args.output_prefix}_{i}", key, level))
            builder.finalize(out + ".idx")
    except BaseException:
        for key in args.json_keys:
            for prefix in [args.output_prefix] + [f"{args.output_prefix}_{i}" for i in range(len(paths))]:
                _remove_dataset(_output_prefix(prefix, key, level))
        raise


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="Tokenize JSON lines into Megatron .bin/.idx files")
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True, help="JSON-lines file (.jsonl or .jsonl.gz; glob "
                       "with --partitions)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each line")
    group.add_argument("--split-sentences", action="store_true", help="store one sequence per sentence")
    group.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences")
    group.add_argument("--skip-malformed", action="store_true",
                       help="skip (and count) malformed lines instead of stopping at the first one")
    group = parser.add_argument_group(title="tokenization process")
    group.add_argument("--append-eod", action="store_true", help="append an EOD token to every document")
    group.add_argument("--lang", type=str, default="english", help="language of the sentence splitter")
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", type=str, required=True,
                       choices=["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
                                "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                                "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer"])
    group.add_argument("--tokenizer-model", type=str, default=None)
    group.add_argument("--vocab-file", type=str, default=None)
    group.add_argument("--vocab-size", type=int, default=None)
    group.add_argument("--merge-file", type=str, default=None)
    group.add_argument("--vocab-extra-ids", type=int, default=0)
    group.add_argument("--tiktoken-pattern", type=str, default=None)
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    group.add_argument("--tiktoken-special-tokens", type=str, nargs="+", default=None)
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True, help="path prefix of the output files")
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, required=True, help="tokenizer processes in total")
    group.add_argument("--partitions", type=int, default=1, help="split the input into this many parts")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="partition the input in contiguous chunks instead of round-robin")
    args = parser.parse_args(argv)
    if args.lang != "english" and args.split_sentences:
        parser.error(f"--lang {args.lang}: the built-in sentence splitter supports english only")
    if args.workers < 1 or args.partitions < 1 or args.workers % args.partitions != 0:
        parser.error("--workers must be a positive multiple of --partitions")
    # the tokenizer builder reads these; preprocessing pads nothing and prints no padding line
    args.rank = 1
    args.make_vocab_size_divisible_by = 128
    args.tensor_model_parallel_size = 1
    return args


if __name__ == "__main__":
    main()
