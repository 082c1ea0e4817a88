"""Run by tests/gpu/test_tp_comm_overlap_gpu.py under torchrun on 2 GPUs: the groups initialize_model_parallel
builds carry the NCCL options of --high-priority-stream-groups / --nccl-communicator-config-path."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron.core import parallel_state as ps  # noqa: E402

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
torch.distributed.init_process_group("nccl")
ps.initialize_model_parallel(tensor_model_parallel_size=2, nccl_communicator_config_path=sys.argv[1],
                             high_priority_stream_groups=["tp"])
cuda = torch.device("cuda")
tp = ps.get_tensor_model_parallel_group()._get_backend(cuda).options
dp = ps.get_data_parallel_group()._get_backend(cuda).options
assert tp.is_high_priority_stream and tp.config.max_ctas == 8, (tp.is_high_priority_stream, tp.config.max_ctas)
assert not dp.is_high_priority_stream
t = torch.ones(4, device=cuda)
torch.distributed.all_reduce(t, group=ps.get_tensor_model_parallel_group())
assert t.tolist() == [2.0] * 4
print("nccl options ok", flush=True)
ps.destroy_model_parallel()
torch.distributed.destroy_process_group()
