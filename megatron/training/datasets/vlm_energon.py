"""Megatron Energon loaders for pretrain_vlm.py (imported only when an Energon dataset is used).

The dataset is a crude WebDataset (tools/prepare_vlm_energon.py or ``energon prepare`` with the crude
flavour): each sample holds its JSON record (``json``) and its image files. A cooker keeps them as raw
bytes; the task encoder turns them into our sample dicts with the same code, errors and image processing
(on Energon's workers) as the JSONL path, and batches them with the same collate function.
"""
import io
import json

import megatron.energon as energon
from megatron.core import parallel_state

from .vlm_dataset import BadSample, collate_vlm, encode_record


@energon.edataclass
class ImageTextRecord(energon.Sample):
    """A crude sample's JSON record and files, undecoded."""
    record: bytes
    files: dict


@energon.stateless
def cook(crude: dict) -> ImageTextRecord:
    files = {k: v for k, v in crude.items() if not k.startswith("__") and k != "json"}
    return ImageTextRecord(**energon.basic_sample_keys(crude), record=crude.get("json", b""), files=files)


class ImageTextTaskEncoder(energon.DefaultTaskEncoder):
    """Cooked records -> sample dicts -> batches (collate_vlm)."""
    cookers = [energon.Cooker(cook)]
    decoder = None  # raw bytes: images go through the same reader (and errors) as the JSONL path

    def __init__(self, path, tokenizer, config):
        super().__init__()
        self.path, self.tokenizer, self.config = path, tokenizer, config

    @energon.stateless
    def encode_sample(self, sample: ImageTextRecord):
        where = f"{self.path}:{sample.__key__}"
        try:
            record = json.loads(sample.record)
        except ValueError:
            raise BadSample(f"{where}: the sample has no readable .json record") from None

        def open_image(name):
            if name not in sample.files:
                raise BadSample(f"{where}: image {name} is not in the sample")
            return io.BytesIO(sample.files[name])
        return encode_record(record, where, open_image, self.tokenizer, self.config)

    def batch(self, samples):
        return collate_vlm(samples)


def energon_loader(path, part, tokenizer, config, micro_batch_size: int, num_workers: int):
    """Energon's loader of split part ``part`` (train repeats forever; val/test are one pass), sharded over
    this rank's data-parallel group. Bad samples stop the run unless config.skip_bad_samples."""
    handler = energon.log_exception if config.skip_bad_samples else energon.reraise_exception
    worker_config = energon.WorkerConfig(rank=parallel_state.get_data_parallel_rank(),
                                         world_size=parallel_state.get_data_parallel_world_size(),
                                         num_workers=num_workers, global_error_handler=handler)
    common = dict(worker_config=worker_config, batch_size=micro_batch_size,
                  task_encoder=ImageTextTaskEncoder(path, tokenizer, config))
    if part == "train":
        dataset = energon.get_train_dataset(path, split_part="train", shuffle_buffer_size=None,
                                            max_samples_per_sequence=None, **common)
    else:
        dataset = energon.get_val_dataset(path, split_part=part, **common)
    return energon.get_loader(dataset)
