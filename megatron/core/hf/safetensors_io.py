"""Stream Hugging Face safetensors: read tensor by tensor, write in shards with an index.

Reading opens each shard lazily with ``safe_open`` (memory-mapped) and copies out one tensor at a
time, so a conversion holds at most the tensors it is working on, never the whole model twice.
"""
import json
import os
from typing import Dict, Optional

import torch

INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
SINGLE_NAME = "model.safetensors"
# (the name a mapping table uses, other spellings of that prefix in files on the Hub or from other
# transformers versions): LLaVA's vision tower, projector and language model.
_LAYOUT_PREFIXES = (
    ("vision_tower.", ("vision_tower.vision_model.", "model.vision_tower.", "model.vision_tower.vision_model.")),
    ("multi_modal_projector.", ("model.multi_modal_projector.",)),
    ("language_model.model.", ("model.language_model.",)),
    ("language_model.lm_head.", ("lm_head.",)))


def _safetensors():
    try:
        import safetensors.torch  # noqa: F401  # lazy: optional dependency, needed only for HF conversion
        from safetensors import safe_open  # lazy: optional dependency, needed only for HF conversion
    except ImportError as e:
        raise ImportError("Hugging Face conversion needs the 'safetensors' package: pip install safetensors") from e
    return safe_open


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: --load-dir / --hf-model-path must be a Hugging Face model "
                                f"directory (config.json + *.safetensors)")
    with open(path) as f:
        return json.load(f)


class SafetensorsReader:
    """``get(name)``: one tensor from a (sharded or single-file) safetensors checkpoint."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        self._safe_open = _safetensors()
        self._handles = {}
        index = os.path.join(hf_dir, INDEX_NAME)
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map: Dict[str, str] = json.load(f)["weight_map"]
            for shard in sorted(set(self.weight_map.values())):
                if not os.path.isfile(os.path.join(hf_dir, shard)):
                    raise FileNotFoundError(f"shard {os.path.join(hf_dir, shard)} is missing (listed in {index}); "
                                            f"download the complete checkpoint")
        elif os.path.isfile(os.path.join(hf_dir, SINGLE_NAME)):
            with self._safe_open(os.path.join(hf_dir, SINGLE_NAME), framework="pt") as f:
                self.weight_map = {k: SINGLE_NAME for k in f.keys()}
        else:
            raise FileNotFoundError(f"{hf_dir} has neither {INDEX_NAME} nor {SINGLE_NAME} (only safetensors "
                                    f"checkpoints are read; re-save the model with save_pretrained)")

    def resolve(self, name: str) -> Optional[str]:
        """The stored name of ``name`` (GPT-2 hub files drop the ``transformer.`` prefix; LLaVA files name
        their parts as older or newer transformers save them, see _LAYOUT_PREFIXES)."""
        if name in self.weight_map:
            return name
        short = name.split(".", 1)[1] if name.startswith("transformer.") else None
        if short in self.weight_map:
            return short
        for prefix, others in _LAYOUT_PREFIXES:
            if name.startswith(prefix):
                for other in others:
                    if other + name[len(prefix):] in self.weight_map:
                        return other + name[len(prefix):]
        return None

    def _open(self, name: str):
        stored = self.resolve(name)
        if stored is None:
            raise KeyError(f"tensor {name} not found in {self.hf_dir} (config.json and weights disagree?)")
        shard = self.weight_map[stored]
        if shard not in self._handles:
            self._handles.clear()  # one shard mapped at a time
            self._handles[shard] = self._safe_open(os.path.join(self.hf_dir, shard), framework="pt")
        return self._handles[shard], stored

    def get(self, name: str) -> torch.Tensor:
        handle, stored = self._open(name)
        return handle.get_tensor(stored)

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor of the stored shape and dtype (read from the header, no data)."""
        handle, stored = self._open(name)
        sl = handle.get_slice(stored)
        return torch.empty(sl.get_shape(), dtype=_DTYPES[sl.get_dtype()], device="meta")

    def close(self) -> None:
        self._handles.clear()


class ShardedSafetensorsWriter:
    """``add(name, tensor)`` buffers up to ``max_shard_bytes`` and flushes a shard; ``close()`` names the
    shards ``model-0000k-of-0000n.safetensors`` and writes the index (a single shard is ``model.safetensors``)."""

    def __init__(self, out_dir: str, max_shard_bytes: int = 5 * 2 ** 30):
        _safetensors()
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        os.makedirs(out_dir, exist_ok=True)
        self._buf, self._buf_bytes, self._shards, self.weight_map, self.total = {}, 0, [], {}, 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + n > self.max_shard_bytes:
            self._flush()
        self._buf[name] = tensor.contiguous()
        self._buf_bytes += n
        self.total += n

    def _flush(self) -> None:
        from safetensors.torch import save_file  # lazy: optional dependency, needed only for HF conversion
        tmp = f"model-{len(self._shards) + 1:05d}.safetensors.tmp"
        save_file(self._buf, os.path.join(self.out_dir, tmp), metadata={"format": "pt"})
        self._shards.append((tmp, list(self._buf)))
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> None:
        if self._buf or not self._shards:
            self._flush()
        n = len(self._shards)
        for k, (tmp, names) in enumerate(self._shards, 1):
            final = SINGLE_NAME if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, final))
            self.weight_map.update({name: final for name in names})
        if n > 1:
            with open(os.path.join(self.out_dir, INDEX_NAME), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))},
                          f, indent=2)
