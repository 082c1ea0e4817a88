"""An --fp8-format resume of a checkpoint whose Transformer Engine modules saved FP8 scaling state (Megatron-LM's
delayed-scaling --fp8-format run) is refused in one line naming the object and what to do."""
import pickle

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedObject
from megatron.training.checkpointing import load

KEY = "decoder.layers.mlp.linear_fc2._extra_state"


def _save(path, state):
    data = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)  # TE's extra state encoding
    dc.save({"e": ShardedObject(KEY, [data], (1,), (0,), replica_id=0)}, str(path))


def test_fp8_scaling_state_is_refused_naming_the_object(tmp_path):
    _save(tmp_path, {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match=rf"{KEY}/shard_0_1 holds Transformer Engine FP8 scaling state.*"
                                         r"without --fp8-format.*--finetune"):
        load._refuse_fp8_scaling_state(str(tmp_path))


def test_extra_state_without_fp8_loads(tmp_path):
    _save(tmp_path, None)
    load._refuse_fp8_scaling_state(str(tmp_path))
