"""--adlr-autoresume: when the cluster's service asks the job to stop, save, request the resumption, exit.

Its own module because it sits above checkpointing (it saves) while ``megatron.training.utils``, where
Megatron keeps the name, sits below it (checkpointing prints through it).
"""
import sys

import torch

from megatron.training.async_utils import maybe_finalize_async_save
from megatron.training.checkpointing import save_checkpoint
from megatron.training.global_vars import get_adlr_autoresume, get_args
from megatron.training.utils import get_rank_safe, print_rank_0


def check_adlr_autoresume_termination(iteration, model, optimizer, opt_param_scheduler):
    """--adlr-autoresume: when the cluster's service asks this job to stop, save a checkpoint (with
    --save), request the job's resumption (rank 0) and exit 0. Collective: every rank calls it."""
    args = get_args()
    autoresume = get_adlr_autoresume()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank asks the service at the same iteration
    if autoresume.termination_requested():
        if args.save:
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                            args.num_floating_point_operations_so_far)
            maybe_finalize_async_save(blocking=True, terminate=True)  # the process ends next
        print_rank_0(">>> autoresume termination request found!")
        if get_rank_safe() == 0:
            autoresume.request_resume()
        print_rank_0(">>> training terminated. Returning")
        sys.exit(0)
