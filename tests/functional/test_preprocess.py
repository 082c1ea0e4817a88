"""tools/preprocess_data.py and tools/merge_datasets.py end to end through the CLI."""
import gzip
import json
import os
import subprocess
import sys

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.tokenizer.tokenizer import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(ROOT, "data/vocab.json"),
       "--merge-file", os.path.join(ROOT, "data/merges.txt")]


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _write_jsonl(path, texts, bad_line=None):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write((bad_line if i == 3 and bad_line else json.dumps({"text": t})) + "\n")


def _tokenizer():
    from types import SimpleNamespace
    return build_tokenizer(SimpleNamespace(tokenizer_type="GPT2BPETokenizer", vocab_file=TOK[3], merge_file=TOK[5],
                                           rank=1))


TEXTS = [f"Document {i}. It has two sentences about lists and dicts." for i in range(40)] + [""]


def test_preprocess_documents_and_partitions(tmp_path):
    inp = str(tmp_path / "in.jsonl.gz")
    _write_jsonl(inp, TEXTS)
    out = _run("tools/preprocess_data.py", "--input", inp, "--output-prefix", str(tmp_path / "p"), *TOK,
               "--append-eod", "--workers", "2", "--log-interval", "10")
    assert out.returncode == 0, out.stderr
    assert "Processed 40 documents" in out.stderr and "MB/s" in out.stderr
    ds = IndexedDataset(str(tmp_path / "p_text_document"))
    tok = _tokenizer()
    assert ds.index.dtype == numpy.uint16 and len(ds) == 40 and len(ds.document_indices) == 42  # empty doc kept
    for i in (0, 39):
        numpy.testing.assert_array_equal(ds[i], tok.tokenize(TEXTS[i]) + [tok.eod])
    out = _run("tools/preprocess_data.py", "--input", inp, "--output-prefix", str(tmp_path / "q"), *TOK,
               "--append-eod", "--workers", "2", "--partitions", "2", "--keep-sequential-samples")
    assert out.returncode == 0, out.stderr
    merged = IndexedDataset(str(tmp_path / "q_text_document"))
    assert sorted(map(tuple, (merged[i].tolist() for i in range(40)))) == \
        sorted(map(tuple, (ds[i].tolist() for i in range(40))))


def test_split_sentences_and_merge_tool(tmp_path):
    inp = str(tmp_path / "in.jsonl")
    _write_jsonl(inp, TEXTS[:5])
    out = _run("tools/preprocess_data.py", "--input", inp, "--output-prefix", str(tmp_path / "s"), *TOK,
               "--split-sentences", "--workers", "1")
    assert out.returncode == 0, out.stderr
    ds = IndexedDataset(str(tmp_path / "s_text_sentence"))
    assert len(ds) == 10 and ds.document_indices.tolist() == [0, 2, 4, 6, 8, 10]
    os.makedirs(tmp_path / "m")
    for name in ("a", "b"):
        for ext in (".bin", ".idx"):
            os.link(str(tmp_path / "s_text_sentence") + ext, str(tmp_path / "m" / name) + ext)
    out = _run("tools/merge_datasets.py", "--input", str(tmp_path / "m"), "--output-prefix", str(tmp_path / "mm"))
    assert out.returncode == 0, out.stderr
    assert len(IndexedDataset(str(tmp_path / "mm"))) == 20


def test_malformed_line_stops_or_is_skipped(tmp_path):
    inp = str(tmp_path / "bad.jsonl")
    _write_jsonl(inp, TEXTS[:10], bad_line='{"text": "unterminated')
    out = _run("tools/preprocess_data.py", "--input", inp, "--output-prefix", str(tmp_path / "b"), *TOK,
               "--workers", "1")
    assert out.returncode != 0 and f"{inp}:4: invalid JSON" in out.stderr
    out = _run("tools/preprocess_data.py", "--input", inp, "--output-prefix", str(tmp_path / "b"), *TOK,
               "--workers", "1", "--skip-malformed")
    assert out.returncode == 0 and "Skipped 1 malformed lines" in out.stderr
    assert len(IndexedDataset(str(tmp_path / "b_text_document"))) == 9
