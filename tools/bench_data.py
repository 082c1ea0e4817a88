"""Data-pipeline benchmark: preprocessing throughput and memory, GPTDataset index build time.

    python tools/bench_data.py --workers 1 --scale 10 --num-docs 1000000 --tokens 100000000
"""
import argparse
import gzip
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)


def _preprocess(inp, prefix, workers):
    """Run the real CLI in a child; return (seconds, peak RSS of the child tree in MB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.time()
    subprocess.run([sys.executable, os.path.join(ROOT, "tools/preprocess_data.py"), "--input", inp,
                    "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
                    "--vocab-file", os.path.join(ROOT, "data/vocab.json"),
                    "--merge-file", os.path.join(ROOT, "data/merges.txt"), "--append-eod",
                    "--workers", str(workers), "--log-interval", "100000000"], check=True, capture_output=True)
    seconds = time.time() - t
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return seconds, max(peak, before) / 1024


def bench_preprocess(tmp, workers, scale):
    src = os.path.join(ROOT, "data/corpus.jsonl.gz")
    with gzip.open(src, "rb") as f:
        raw = f.read()
    for factor in (1, scale):
        inp = os.path.join(tmp, f"corpus_x{factor}.jsonl")
        with open(inp, "wb") as f:
            for _ in range(factor):
                f.write(raw)
        seconds, peak_mb = _preprocess(inp, os.path.join(tmp, f"out_x{factor}"), workers)
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        tokens = int(IndexedDataset(os.path.join(tmp, f"out_x{factor}_text_document")).sequence_lengths.sum())
        mb = len(raw) * factor / 1e6
        print(f"preprocess x{factor}: {mb:.1f} MB in {seconds:.1f} s with {workers} worker(s): "
              f"{mb / seconds / workers:.2f} MB/s/worker, {tokens / seconds / workers:,.0f} tokens/s/worker, "
              f"peak RSS {peak_mb:.0f} MB (largest single process)", flush=True)


def bench_index_build(tmp, num_docs, tokens):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import _write_index
    from megatron.training.tokenizer.tokenizer import _NullTokenizer

    rng = numpy.random.default_rng(0)
    lengths = rng.integers(1, 2 * tokens // num_docs, size=num_docs).astype(numpy.int32)
    prefix = os.path.join(tmp, "big")
    _write_index(prefix + ".idx", numpy.uint16, lengths, numpy.arange(num_docs + 1))
    with open(prefix + ".bin", "wb") as f:  # sparse: index building never reads token bytes
        f.truncate(int(lengths.sum()) * 2)
    seq = 2048
    cfg = GPTDatasetConfig(random_seed=1234, sequence_length=seq, blend=([prefix], None), split="100,0,0",
                           path_to_cache=os.path.join(tmp, "cache"), tokenizer=_NullTokenizer(vocab_size=50000),
                           reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    samples = int(lengths.sum()) // seq
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.time()
    BlendedMegatronDatasetBuilder(GPTDataset, [samples, None, None], lambda: True, cfg).build()
    built = time.time() - t
    t = time.time()
    BlendedMegatronDatasetBuilder(GPTDataset, [samples, None, None], lambda: True, cfg).build()
    cached = time.time() - t
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"GPTDataset index build: {int(lengths.sum()):,} tokens / {num_docs:,} documents, seq {seq}, "
          f"{samples:,} samples: {built:.2f} s (cached reload {cached:.2f} s), "
          f"peak RSS {rss1 / 1024:.0f} MB (+{(rss1 - rss0) / 1024:.0f} MB)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--scale", type=int, default=10, help="input growth factor for the memory check")
    parser.add_argument("--num-docs", type=int, default=1_000_000)
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--skip-preprocess", action="store_true")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_data_")
    try:
        if not args.skip_preprocess:
            bench_preprocess(tmp, args.workers, args.scale)
        bench_index_build(tmp, args.num_docs, args.tokens)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
