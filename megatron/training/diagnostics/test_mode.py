"""--test-mode (Megatron's "run all real-time tests alongside the experiment"): at the start of training and
every --log-interval iterations, after the optimizer step, the parameters the layout replicates must be bitwise
identical on every rank holding a copy (megatron.core.distributed.replica_checks); a copy that differs (silent
memory, network or checkpoint corruption) stops every rank with one line naming the parameter, group and ranks.
Megatron checks only the QK-layernorm weights, in every attention forward; this checks every replicated
parameter, at the log cadence."""
from megatron.core.distributed.replica_checks import find_replica_mismatch
from megatron.training.utils import print_rank_0


def check_replicas(model, iteration: int, args, first: bool = False) -> None:
    """``first``: the check at the start of training, which also says that the mode is on."""
    if not args.test_mode:
        return
    for chunk in model:  # the distributed optimizer's overlapped param all-gathers land first
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()
    message = find_replica_mismatch(model)
    if message is not None:
        raise RuntimeError(f"--test-mode: {message} after {iteration} iterations")
    if first:
        print_rank_0(f"--test-mode: replicated parameters identical across dp/edp/tp/etp ranks after {iteration} "
                     f"iterations; checked again every {args.log_interval} iterations")
