"""ShardedTensors <-> torch.distributed.checkpoint (DCP) files.

Every shard is written as a chunk of its global tensor (key, global shape, offset), so DCP's metadata
describes global tensors independent of the layout that wrote them. Loading asks DCP for the chunk the
current layout needs; DCP reads the overlapping parts of whichever saved chunks cover it.
"""
import io
import os
import shutil
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio, create_read_items_for_chunk_list

from ..core import CheckpointingException
from ..mapping import ShardedBase, ShardedObject, ShardedTensor
from ..megatron_layout import missing_tensor_message
from ..validation import save_integrity_manifest


class MCoreMetadata:
    """Unpickling target only: `.metadata` files written by Megatron Core 0.15 with optimizer state
    pickle an object of this class path; its attributes (state_dict_metadata, storage_data...) are
    restored as they were saved, which is all reading needs."""


class MCoreSavePlan:
    """Unpickling target only, for the save plans some older Megatron checkpoints pickle."""


# fqn -> [(global offset, local tensor with prepended axes, global shape)]
Shards = Dict[str, List[Tuple[Tuple[int, ...], torch.Tensor, Tuple[int, ...]]]]


def _expanded(sh: ShardedTensor, tensor: torch.Tensor) -> torch.Tensor:
    """View ``tensor`` with the ``prepend_axis_num`` leading global axes of size 1."""
    return tensor.reshape((1,) * sh.prepend_axis_num + tuple(tensor.shape))


def tensor_shards(sharded: List[ShardedTensor], tensors: List[torch.Tensor]) -> Shards:
    out: Shards = {}
    for sh, t in zip(sharded, tensors):
        t = _expanded(sh, t)
        if len(sh.global_offset) != t.dim():
            raise CheckpointingException(
                f"ShardedTensor {sh.key}: global offset {sh.global_offset} does not match local shape {tuple(t.shape)}")
        chunks = out.setdefault(sh.key, [])
        if any(off == tuple(sh.global_offset) for off, _, _ in chunks):
            raise CheckpointingException(f"ShardedTensor {sh.key} at offset {sh.global_offset} given twice on one rank")
        chunks.append((tuple(sh.global_offset), t, tuple(sh.global_shape)))
    return out


class _SavePlanner(DefaultSavePlanner):
    """Writes each local shard as a chunk of its global tensor; objects as bytes."""

    def __init__(self, shards: Shards):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, chunks in self.shards.items():
            for offset, t, global_shape in chunks:
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offset)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=t.size()),
                        properties=TensorProperties.create_from_tensor(t), size=torch.Size(global_shape))))
        for fqn in self.state_dict:
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.shards:
            for offset, t, _ in self.shards[index.fqn]:
                if torch.Size(offset) == index.offset:
                    return t
        return self.state_dict[index.fqn]


class _LoadPlanner(DefaultLoadPlanner):
    """Reads the chunk each local ShardedTensor asks for, from whatever saved chunks overlap it."""

    def __init__(self, shards: Shards, object_keys: List[str], checkpoint_dir: str, allow_shape_mismatch=()):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.shards, self.object_keys, self.checkpoint_dir = shards, object_keys, checkpoint_dir
        self.allow_shape_mismatch = set(allow_shape_mismatch)
        self.loaded_objects = {}

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        items = []
        for fqn, chunks in self.shards.items():
            if fqn not in md:
                raise CheckpointingException(missing_tensor_message(fqn, self.checkpoint_dir, md))
            saved = md[fqn]
            if isinstance(saved, BytesStorageMetadata):
                raise CheckpointingException(f"checkpoint {self.checkpoint_dir}: '{fqn}' is an object, not a tensor")
            for offset, t, global_shape in chunks:
                if len(saved.size) != len(global_shape):
                    raise CheckpointingException(
                        f"checkpoint {self.checkpoint_dir}: '{fqn}' has global shape {tuple(saved.size)}, the model "
                        f"expects {tuple(global_shape)} (another number of dims: allow_shape_mismatch pads or trims "
                        "dims, it does not add them); reshape the request to the saved dims")
                if tuple(saved.size) != tuple(global_shape) and fqn not in self.allow_shape_mismatch:
                    raise CheckpointingException(
                        f"checkpoint {self.checkpoint_dir}: '{fqn}' has global shape {tuple(saved.size)}, "
                        f"the model expects {tuple(global_shape)}")
            local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t, _ in chunks]
            items.extend(create_read_items_for_chunk_list(fqn, saved, local))
        for fqn in self.object_keys:
            if fqn not in md:
                raise CheckpointingException(f"checkpoint {self.checkpoint_dir} has no object '{fqn}'")
            idx = MetadataIndex(fqn)
            items.append(_create_read_item_for_byteio(idx, 0, idx, 0, 0))
        return LoadPlan(items)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.loaded_objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        chunks = self.shards[index.fqn]
        if index.index is not None and index.index < len(chunks) and torch.Size(chunks[index.index][0]) == index.offset:
            return chunks[index.index][1]
        for offset, t, _ in chunks:
            if torch.Size(offset) == index.offset:
                return t
        raise KeyError(index)


class TorchDistSaveShardedStrategy:
    """The torch_dist format as a strategy object for ``dist_checkpointing.save(sharded_strategy=...)``.

    ``thread_count`` sets the writer threads per rank; ``cached_metadata`` (Megatron reuses the global
    save plan across saves, a speed-up) has no effect here, same files. Only main replicas are written.
    """

    def __init__(self, backend: str = "torch_dist", version: int = 1, keep_only_main_replica: bool = True,
                 thread_count: int = 1, cached_metadata: bool = False, separation_hint: Optional[str] = None,
                 cpu_shm_mode: bool = False):
        if backend != "torch_dist" or version != 1:
            raise ValueError(f"TorchDistSaveShardedStrategy: backend {backend!r} version {version} is not "
                             "supported; use ('torch_dist', 1)")
        if not keep_only_main_replica or separation_hint is not None or cpu_shm_mode:
            raise NotImplementedError("TorchDistSaveShardedStrategy: keep_only_main_replica=False, "
                                      "separation_hint and cpu_shm_mode are not supported")
        self.backend, self.version, self.thread_count = backend, version, thread_count


class TorchDistLoadShardedStrategy:
    """The torch_dist format as a strategy object for ``dist_checkpointing.load(sharded_strategy=...)``.
    ``cache_metadata`` (a speed-up) and ``stream_ckpt_dequant`` (FP8 checkpoints, none here) have no
    effect here, same result."""

    def __init__(self, cache_metadata: bool = False, stream_ckpt_dequant: bool = True,
                 checkpoint_name: Optional[str] = None):
        if checkpoint_name is not None:
            raise NotImplementedError("TorchDistLoadShardedStrategy(checkpoint_name=...) is not supported")
        self.backend, self.version = "torch_dist", 1

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str):
        """Remove every tensor and object whose key starts with ``key_prefix`` from the checkpoint.

        Files here hold one rank's shards of all keys (``__{rank}_0.distcp``), not one key prefix each,
        so the kept entries are read whole and written again into a sibling directory, which then
        replaces ``checkpoint_dir``: a failure before the swap leaves the original untouched. Local to
        the calling process (call it on one rank); the kept tensors are held in host memory meanwhile.
        """
        md = read_metadata(checkpoint_dir)
        entries = md.state_dict_metadata
        if not any(k.startswith(key_prefix) for k in entries):
            warnings.warn(f'There are no entries in {checkpoint_dir} that begin with "{key_prefix}". '
                          'Skipping removal.')
            return
        keep = [k for k in entries if not k.startswith(key_prefix)]
        shards = {k: [((0,) * len(entries[k].size), torch.empty(tuple(entries[k].size),
                                                                 dtype=entries[k].properties.dtype),
                       tuple(entries[k].size))]
                  for k in keep if not isinstance(entries[k], BytesStorageMetadata)}
        object_keys = [k for k in keep if isinstance(entries[k], BytesStorageMetadata)]
        # Empty tensors have no chunk to read; they are written back empty.
        readable = {k: v for k, v in shards.items() if v[0][1].numel()}
        objects = dcp_read(checkpoint_dir, readable, object_keys, no_dist=True) if readable or object_keys else {}
        tmp = checkpoint_dir.rstrip(os.sep) + ".removing"
        old = checkpoint_dir.rstrip(os.sep) + ".removed"
        for d in (tmp, old):
            if os.path.exists(d):
                raise RuntimeError(f"remove_sharded_tensors: {d} exists (left by an interrupted removal); "
                                   f"check it against {checkpoint_dir} and delete it")
        try:
            os.makedirs(tmp)
            dcp_write(tmp, shards, objects, no_dist=True)
            for name in os.listdir(checkpoint_dir):  # common state, metadata.json and anything else
                src, dst = os.path.join(checkpoint_dir, name), os.path.join(tmp, name)
                if os.path.isdir(src):
                    shutil.copytree(src, dst)
                elif not name.endswith(".distcp") and name != ".metadata":
                    shutil.copy2(src, dst)
            if os.path.exists(os.path.join(tmp, "integrity.json")):
                save_integrity_manifest(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        os.rename(checkpoint_dir, old)
        os.rename(tmp, checkpoint_dir)
        shutil.rmtree(old)


def dcp_write(checkpoint_dir: str, shards: Shards, objects: Dict[str, object], process_group=None,
              thread_count: int = 1, no_dist=None) -> None:
    """Write ``shards`` and ``objects`` (already deduplicated by replica) into ``checkpoint_dir``."""
    on_host = all(t.device.type == "cpu" for chunks in shards.values() for _, t, _ in chunks)
    # Host tensors (an async save's copies) are written as they are: DCP's copy-ahead loader would
    # synchronize the CUDA stream of the writing thread (the training stream) between tensors for nothing.
    writer = FileSystemWriter(checkpoint_dir, single_file_per_rank=True, thread_count=thread_count,
                              **({"per_thread_copy_ahead": 0} if on_host else {}))
    if no_dist is None:
        no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    dcp_save(dict(objects), storage_writer=writer, planner=_SavePlanner(shards),
             process_group=process_group, no_dist=no_dist)


class _NamingReader(FileSystemReader):
    """DCP's file reader, whose failures name the file and byte range they came from (DCP's own error only
    says that some item would not deserialize)."""

    _where = None

    def _slice_file(self, file, sinfo):
        self._where = (sinfo.relative_path, sinfo.offset, sinfo.length)
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        self._where = None
        try:
            return super().read_data(plan, planner)
        except CheckpointingException:
            raise
        except Exception as e:
            if self._where is None:
                raise
            rel, offset, length = self._where
            path = os.path.join(str(self.path), rel)
            size = os.path.getsize(path) if os.path.isfile(path) else 0
            if size < offset + length:
                raise CheckpointingException(f"truncated or missing file(s) {path} ({size} bytes; the checkpoint's "
                                             f"metadata records {offset + length})") from e
            raise CheckpointingException(
                f"corrupted checkpoint file {path} (bytes {offset}-{offset + length}): "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def dcp_read(checkpoint_dir: str, shards: Shards, object_keys: List[str], process_group=None,
             allow_shape_mismatch=(), no_dist=None) -> Dict[str, object]:
    """Fill the tensors in ``shards`` in place from ``checkpoint_dir``; return the requested objects."""
    planner = _LoadPlanner(shards, object_keys, checkpoint_dir, allow_shape_mismatch)
    if no_dist is None:
        no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    placeholder = {k: None for k in object_keys}
    placeholder.update({k: v[0][1] for k, v in shards.items()})
    dcp_load(placeholder, storage_reader=_NamingReader(checkpoint_dir), planner=planner,
             process_group=process_group, no_dist=no_dist)
    return planner.loaded_objects


def read_metadata(checkpoint_dir: str):
    """DCP global metadata (``.metadata``): keys, global shapes, dtypes and file locations."""
    return FileSystemReader(checkpoint_dir).read_metadata()


def object_shards(objects: List[ShardedObject]) -> Dict[str, object]:
    return {o.unique_key: o.data for o in objects}


def flatten_state_dict(state_dict):
    """(one-level dict keyed by dotted paths, {dotted path: path tuple}) of a nested state dict.
    Tensors and ShardedTensors/Objects are leaves, as are lists holding only plain values; other
    lists are walked by index."""
    flat, paths = {}, {}

    def walk(value, path):
        plain_list = isinstance(value, list) and not any(isinstance(v, (dict, list, torch.Tensor, ShardedBase))
                                                         for v in value)
        if isinstance(value, dict) or (isinstance(value, list) and not plain_list):
            for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
                walk(v, path + (k,))
            return
        fqn = ".".join(map(str, path))
        if fqn in flat:
            raise ValueError(f"duplicated flatten key {fqn}")
        flat[fqn], paths[fqn] = value, path

    for key, value in state_dict.items():
        walk(value, (key,))
    return flat, paths
