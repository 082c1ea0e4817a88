"""Checkpoint-level metadata (``metadata.json``) and the checkpointing exception."""
import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

CONFIG_FNAME = "metadata.json"
SHARDED_BACKEND = "torch_dist"
SHARDED_BACKEND_VERSION = 1


class CheckpointingException(Exception):
    """A checkpoint could not be saved or read (missing files, corruption, key or shape mismatch)."""


@dataclass
class CheckpointingConfig:
    """The backend that wrote a checkpoint, as recorded in ``metadata.json``."""

    sharded_backend: str
    sharded_backend_version: int = 1


def save_config(config: Optional[CheckpointingConfig], checkpoint_dir: str) -> None:
    """Write ``metadata.json`` (None: torch_dist); it is written last, so its presence marks a complete
    checkpoint."""
    config = asdict(config or CheckpointingConfig(SHARDED_BACKEND, SHARDED_BACKEND_VERSION))
    config.update(common_backend="torch", common_backend_version=1)
    path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(config, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def maybe_load_config(checkpoint_dir: str) -> Optional[dict]:
    """Return the parsed ``metadata.json`` or None when the directory is not a complete dist checkpoint."""
    path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointingException(f"corrupted checkpoint metadata file {path}: {e}") from e
    if not isinstance(config, dict) or "sharded_backend" not in config:
        raise CheckpointingException(f"corrupted checkpoint metadata file {path}: no 'sharded_backend'")
    return config


def check_is_distributed_checkpoint(checkpoint_dir: str) -> bool:
    """True when ``checkpoint_dir`` holds a complete distributed (torch_dist) checkpoint."""
    return maybe_load_config(checkpoint_dir) is not None
