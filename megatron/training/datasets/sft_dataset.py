"""`--sft` samples: conversations packed into --seq-length with per-document attention.

Each epoch shuffles the split's conversations (numpy RandomState(seed + epoch), so the order depends only
on --seed) and packs them greedily in that order: a conversation joins the current sample while it fits,
else it opens the next one. Sample `idx` is therefore a pure function of (data, seed, seq_length, idx) and
the data loader resumes mid-epoch from consumed samples like any pretraining dataset.

A sample has the keys GPTDataset gives packed documents (pretrain_gpt.get_batch reads them the same way):
tokens, labels, loss_mask (assistant tokens only), position_ids (restarting at each conversation) and
cu_seqlens [s + 1] (document starts, then the end offset repeated). Labels are shifted inside each
conversation, so a conversation of n tokens fills n - 1 positions and never predicts its neighbour.
The tail after the last conversation is padding: its own document, loss-masked.
"""
import logging
import time
from dataclasses import dataclass
from typing import Dict, Optional

import numpy
import torch

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, log_single_rank
from megatron.training.datasets.sft_chat import ChatFormat, load_hf_tokenizer
from megatron.training.datasets.sft_conversations import SFTConversations, load_conversations

logger = logging.getLogger(__name__)


@dataclass
class SFTDatasetConfig(GPTDatasetConfig):
    """GPTDatasetConfig plus where conversations are rendered from: the HF tokenizer directory
    (--tokenizer-model), the prompt format and what to do with a bad record."""

    sft_tokenizer_path: Optional[str] = None
    sft_prompt_format: str = "default"
    sft_bad_records: str = "stop"
    sft_chat_template: Optional[str] = None  # --chat-template: replaces the prompt format's template


def pack_greedy(lengths: numpy.ndarray, order: numpy.ndarray, capacity: int) -> numpy.ndarray:
    """Start index (into `order`) of every sample, plus len(order): conversations are taken in `order` and
    a sample is closed when the next one does not fit its `capacity` positions."""
    starts, used = [0], 0
    for i, k in enumerate(order):
        n = int(lengths[k])
        if used + n > capacity and used > 0:
            starts.append(i)
            used = 0
        used += n
    starts.append(len(order))
    return numpy.asarray(starts, dtype=numpy.int64)


class SFTDataset(MegatronDataset):
    """Packed conversations of one split (see the module docstring)."""

    def __init__(self, dataset: SFTConversations, dataset_path: Optional[str], indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: SFTDatasetConfig):
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        self._pad = 0
        self.order, self.sample_starts = self._build_packing()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: SFTConversations) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: SFTDatasetConfig) -> SFTConversations:
        chat = ChatFormat(load_hf_tokenizer(config.sft_tokenizer_path), config.sft_prompt_format,
                          config.sft_tokenizer_path, config.sft_chat_template)
        t0 = time.time()
        data = load_conversations(dataset_path, chat, config.sequence_length, config.sft_bad_records)
        log_single_rank(logger, logging.INFO, f"> {dataset_path}: {len(data)} conversations, "
                                              f"{int(data.mask.sum())} assistant tokens of {len(data.tokens)} "
                                              f"({time.time() - t0:.1f} s)")
        return data

    @staticmethod
    def _key_config_attributes():
        return MegatronDataset._key_config_attributes() + ["sft_prompt_format", "sft_chat_template"]

    def _build_packing(self):
        """Concatenate epochs of shuffled, packed conversations until `num_samples` samples exist."""
        lengths = self.dataset.lengths() - 1  # positions a conversation fills
        capacity = self.config.sequence_length
        orders, starts, n_samples, epoch = [], [], 0, 0
        if len(self.indices) == 0:
            return numpy.zeros(0, dtype=numpy.int64), numpy.zeros(1, dtype=numpy.int64)
        while True:
            order = numpy.random.RandomState(self.config.random_seed + epoch).permutation(self.indices)
            s = pack_greedy(lengths, order, capacity)
            base = sum(len(o) for o in orders)
            orders.append(order.astype(numpy.int64))
            starts.append(s[:-1] + base)
            n_samples += len(s) - 1
            epoch += 1
            if self.num_samples is None or n_samples >= self.num_samples:
                break
        order = numpy.concatenate(orders)
        sample_starts = numpy.concatenate(starts + [numpy.asarray([len(order)])])
        used = int(lengths[order].sum())
        log_single_rank(logger, logging.INFO,
                        f"> SFT {self.index_split.name}: {len(self.indices)} conversations packed into "
                        f"{len(sample_starts) - 1} samples of {capacity} over {epoch} epoch(s), "
                        f"{100.0 * (1 - used / (capacity * (len(sample_starts) - 1))):.1f}% padding")
        return order, sample_starts

    def __len__(self) -> int:
        return len(self.sample_starts) - 1

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        s = self.config.sequence_length
        tokens = numpy.full(s, self._pad, dtype=numpy.int64)
        labels = numpy.full(s, self._pad, dtype=numpy.int64)
        loss_mask = numpy.zeros(s, dtype=numpy.float32)
        position_ids = numpy.zeros(s, dtype=numpy.int64)
        cu_seqlens = numpy.full(s + 1, s, dtype=numpy.int32)
        cu_seqlens[0] = 0
        at, doc = 0, 1
        docs = [] if idx is None else self.order[self.sample_starts[idx]:self.sample_starts[idx + 1]]
        for k in docs:
            ids, mask = self.dataset.get(int(k))
            n = len(ids) - 1
            tokens[at:at + n] = ids[:-1]
            labels[at:at + n] = ids[1:]
            loss_mask[at:at + n] = mask[1:]
            position_ids[at:at + n] = numpy.arange(n)
            at += n
            if at < s:
                cu_seqlens[doc] = at
                doc += 1
        position_ids[at:] = numpy.arange(s - at)  # the padding tail: one more document
        return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
                "loss_mask": torch.from_numpy(loss_mask), "position_ids": torch.from_numpy(position_ids),
                "cu_seqlens": torch.from_numpy(cu_seqlens)}
