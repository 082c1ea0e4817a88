"""Tokenized SFT conversations: read a JSONL file (or the `.npz` tools/prepare_sft_data.py writes), check
every record, and hold the token ids and assistant masks of all conversations in flat arrays.

A bad record (not JSON, no messages, an unknown role, no assistant turn, a template error, longer than
--seq-length) is reported as one line `file:line: what is wrong`; `on_bad="stop"` raises on the first one,
`on_bad="skip"` drops it and prints the line.
"""
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, List, Optional

import numpy

from megatron.training.datasets.sft_chat import ChatFormat, RecordError, messages_of, split_conversations

FORMAT_VERSION = 1


class BadRecordError(ValueError):
    """A bad record under on_bad="stop": the message is `file:line: what is wrong`."""


@dataclass
class SFTConversations:
    """Conversation k is tokens[offsets[k]:offsets[k + 1]] (ids) and mask[...] (1 on assistant tokens);
    lines[k] is its 1-based line in `source`."""

    tokens: numpy.ndarray
    mask: numpy.ndarray
    offsets: numpy.ndarray
    lines: numpy.ndarray
    source: str
    meta: dict

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> numpy.ndarray:
        return numpy.diff(self.offsets)

    def get(self, k: int):
        beg, end = int(self.offsets[k]), int(self.offsets[k + 1])
        return self.tokens[beg:end], self.mask[beg:end]


def tokenize_jsonl(path: str, chat: ChatFormat, seq_length: Optional[int], on_bad: str = "stop",
                   report: Callable[[str], None] = None) -> SFTConversations:
    """Read, check and tokenize every conversation of a JSONL file. A conversation fits a sample when its
    tokens minus one (the last token only serves as a label) are at most `seq_length`."""
    if on_bad not in ("stop", "skip"):
        raise ValueError(f"on_bad must be 'stop' or 'skip', not {on_bad!r}")
    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    tokens: List[numpy.ndarray] = []
    masks: List[numpy.ndarray] = []
    lines: List[int] = []
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                try:
                    record = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise RecordError(f"not valid JSON ({e.msg} at column {e.colno})") from e
                for conversation in split_conversations(messages_of(record)):
                    ids, mask = chat.tokenize(conversation)
                    if seq_length is not None and len(ids) - 1 > seq_length:
                        raise RecordError(f"conversation of {len(ids)} tokens is longer than --seq-length "
                                          f"{seq_length} + 1; raise --seq-length or shorten it")
                    tokens.append(ids)
                    masks.append(mask)
                    lines.append(lineno)
            except RecordError as e:
                message = f"{path}:{lineno}: {e}"
                if on_bad == "stop":
                    raise BadRecordError(message + " (pass --sft-bad-records skip to drop bad records)") from None
                while lines and lines[-1] == lineno:  # drop the line's earlier conversations too
                    tokens.pop()
                    masks.pop()
                    lines.pop()
                skipped += 1
                report(message + " (skipped)")
    if not tokens:
        raise BadRecordError(f"{path}: no usable conversation" + (f" ({skipped} bad records skipped)"
                                                                    if skipped else ""))
    offsets = numpy.zeros(len(tokens) + 1, dtype=numpy.int64)
    numpy.cumsum([len(t) for t in tokens], out=offsets[1:])
    meta = dict(version=FORMAT_VERSION, prompt_format=chat.prompt_format, template=chat.template,
                seq_length=seq_length, skipped=skipped, source=os.path.abspath(path))
    return SFTConversations(numpy.concatenate(tokens).astype(numpy.int32), numpy.concatenate(masks).astype(numpy.uint8),
                            offsets, numpy.asarray(lines, dtype=numpy.int64), path, meta)


def save_npz(conversations: SFTConversations, out_path: str) -> None:
    """Write atomically: a temporary file in the same directory, renamed over `out_path` when complete."""
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".sft_", suffix=".npz.tmp", dir=out_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            numpy.savez(f, tokens=conversations.tokens, mask=conversations.mask, offsets=conversations.offsets,
                        lines=conversations.lines, meta=numpy.array(json.dumps(conversations.meta)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_npz(path: str, chat: Optional[ChatFormat], seq_length: Optional[int], on_bad: str = "stop",
             report: Callable[[str], None] = None) -> SFTConversations:
    """A prepared file; refused when it was rendered with another template. Conversations longer than this
    run's --seq-length are bad records (stop or skip)."""
    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    with numpy.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        data = SFTConversations(z["tokens"], z["mask"], z["offsets"], z["lines"], path, meta)
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: SFT file format version {meta.get('version')} (expected {FORMAT_VERSION}); "
                         "run tools/prepare_sft_data.py again")
    if chat is not None and meta.get("template") != chat.template:
        raise ValueError(f"{path}: prepared with prompt format {meta.get('prompt_format')!r} and another chat "
                         f"template than this run's ({chat.prompt_format!r}); prepare it again with this tokenizer")
    if seq_length is None:
        return data
    too_long = data.lengths() - 1 > seq_length
    for k in numpy.nonzero(too_long)[0]:
        message = (f"{meta.get('source', path)}:{int(data.lines[k])}: conversation of {int(data.lengths()[k])} "
                   f"tokens is longer than --seq-length {seq_length} + 1")
        if on_bad == "stop":
            raise BadRecordError(message + " (pass --sft-bad-records skip to drop bad records)")
        report(message + " (skipped)")
    if too_long.any():
        keep = numpy.nonzero(~too_long)[0]
        pieces = [data.get(int(k)) for k in keep]
        offsets = numpy.zeros(len(keep) + 1, dtype=numpy.int64)
        numpy.cumsum(data.lengths()[keep], out=offsets[1:])
        data = SFTConversations(numpy.concatenate([t for t, _ in pieces]), numpy.concatenate([m for _, m in pieces]),
                                offsets, data.lines[keep], path, meta)
    return data


def load_conversations(path: str, chat: ChatFormat, seq_length: int, on_bad: str = "stop") -> SFTConversations:
    """A `.npz` from tools/prepare_sft_data.py, else a JSONL file of conversations."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data-path {path}: no such file (SFT takes a JSONL file of conversations "
                                "or the .npz of tools/prepare_sft_data.py)")
    if path.endswith(".npz"):
        return load_npz(path, chat, seq_length, on_bad)
    return tokenize_jsonl(path, chat, seq_length, on_bad)
