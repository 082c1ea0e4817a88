"""T5 span-corruption samples (COMPAT.md 4.8): masked spans leave the encoder input, each replaced by
one sentinel <extra_id_i>; the decoder predicts (sentinel, span tokens)... then [EOS]."""
from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masked_dataset import (
    MaskedWordPieceDataset,
    MaskedWordPieceDatasetConfig,
    MockMaskedLowLevelDataset,
)
from megatron.core.datasets.utils import Split


@dataclass
class T5MaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    sequence_length_encoder: Optional[int] = None
    """Encoder length (--encoder-seq-length / --seq-length)."""

    sequence_length_decoder: Optional[int] = None
    """Decoder length (--decoder-seq-length)."""

    def __post_init__(self):
        super().__post_init__()
        if self.sequence_length_encoder is None or self.sequence_length_decoder is None:
            raise ValueError("T5MaskedWordPieceDatasetConfig needs sequence_length_encoder and "
                             "sequence_length_decoder")
        if self.sequence_length != self.sequence_length_encoder:
            raise ValueError("T5MaskedWordPieceDatasetConfig.sequence_length must equal sequence_length_encoder")
        if not getattr(self.tokenizer, "additional_special_tokens_ids", None):
            raise ValueError("T5 needs sentinel tokens: use --tokenizer-type BertWordPieceCase or pass "
                             "--vocab-extra-ids 100")


class T5MaskedWordPieceDataset(MaskedWordPieceDataset):
    """Keys: text_enc, text_dec, labels (-1 on pads), loss_mask, truncated, enc_mask, dec_mask."""

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: str, indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: T5MaskedWordPieceDatasetConfig):
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        # 2 slots kept free in the encoder input (Megatron's target length)
        self.sample_index = self._build_sample_index(config.sequence_length_encoder - 2, 1)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return super(T5MaskedWordPieceDataset, T5MaskedWordPieceDataset)._key_config_attributes() + [
            "sequence_length_decoder"]

    def _get_token_mask(self, rng: numpy.random.RandomState) -> Optional[int]:
        return self.config.tokenizer.mask  # spans leave the encoder input entirely

    def __getitem__(self, idx: int) -> Dict[str, numpy.ndarray]:
        tok, c = self.config.tokenizer, self.config
        beg, end, target = (int(x) for x in self.sample_index[idx])
        tokens = [int(t) for i in range(beg, end) for t in self.dataset[i]]
        rng = numpy.random.RandomState(seed=(c.random_seed + idx) % 2 ** 32)
        truncated = len(tokens) > target
        tokens = tokens[:target]
        tokens, _, _, spans = self._create_masked_lm_predictions(tokens, target, rng)

        sentinels = deque(tok.additional_special_tokens_ids)
        if len(spans) > len(sentinels):
            raise ValueError(f"sample {idx} has {len(spans)} masked spans but the tokenizer has only "
                             f"{len(sentinels)} sentinels; raise --vocab-extra-ids")
        enc_in, dec_in, dec_out = [], [tok.bos], []
        start = 0
        for positions, labels in spans:
            sentinel = sentinels.popleft()
            enc_in += tokens[start:positions[0]] + [sentinel]
            dec_in += [sentinel, *labels]
            dec_out += [sentinel, *labels]
            start = positions[-1] + 1
        enc_in += tokens[start:]
        dec_out.append(tok.eos)

        pad_enc = c.sequence_length_encoder - len(enc_in)
        pad_dec = c.sequence_length_decoder - len(dec_in)
        assert pad_enc >= 0, "masking only shortens the encoder input"
        if pad_dec < 0:
            raise ValueError(f"sample {idx} needs a decoder length of {len(dec_in)}; raise --decoder-seq-length "
                             f"(now {c.sequence_length_decoder}) or lower --mask-prob")
        loss_mask = numpy.zeros(c.sequence_length_decoder, dtype=numpy.int64)
        loss_mask[:len(dec_in)] = 1
        as_array = lambda xs, pad, value: numpy.pad(numpy.array(xs, dtype=numpy.int64), (0, pad),
                                                    constant_values=value)
        return {
            "text_enc": as_array(enc_in, pad_enc, tok.pad),
            "text_dec": as_array(dec_in, pad_dec, tok.pad),
            "labels": as_array(dec_out, pad_dec, -1),
            "loss_mask": loss_mask,
            "truncated": int(truncated),
            "enc_mask": as_array([1] * len(enc_in), pad_enc, 0),
            "dec_mask": as_array([1] * len(dec_in), pad_dec, 0),
        }


class MockT5MaskedWordPieceDataset(T5MaskedWordPieceDataset):
    """T5MaskedWordPieceDataset over synthetic sentences (`--mock-data`): same keys and masking."""

    def __init__(self, dataset, dataset_path, indexed_indices, num_samples, index_split, config):
        if not config.mock:
            raise ValueError("MockT5MaskedWordPieceDataset needs a config without a data blend (mock data)")
        super().__init__(dataset, dataset_path, indexed_indices, num_samples, index_split, config)

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str],
                                config: T5MaskedWordPieceDatasetConfig) -> MockMaskedLowLevelDataset:
        return MockMaskedLowLevelDataset(config.tokenizer, config.random_seed)
