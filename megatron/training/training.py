"""pretrain(): initialize, build model/optimizer/data, run the training loop, evaluate, exit cleanly."""
import contextlib
import sys
import time
from datetime import datetime

import torch

from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import finalize_model_grads
from megatron.core.distributed.param_hashes import param_hashes_match_across_dp
from megatron.core.num_microbatches_calculator import (
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.rerun_state_machine import (
    RerunDataIterator,
    RerunErrorInjector,
    RerunMode,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)
from megatron.core.utils import device_synchronize, get_device, get_model_config
from megatron.training import gc_control, global_vars, progress_log
from megatron.training.async_utils import maybe_finalize_async_save
from megatron.training.autoresume import check_adlr_autoresume_termination
from megatron.training.checkpointing import reserve_async_save_buffers, save_checkpoint
from megatron.training.config import PretrainConfigContainer
from megatron.training.data_iterators import build_iterators_for_model_chunks
from megatron.training.diagnostics import energy, hang, launches, straggler, test_mode
from megatron.training.diagnostics.errors import report_errors
from megatron.training.diagnostics.profiler import ProfilingWindow
from megatron.training.evaluate import evaluate_and_print_results
from megatron.training.exit import duration_exceeded
from megatron.training.flops import num_floating_point_operations
from megatron.training.global_vars import get_args, get_signal_handler, get_tensorboard_writer, get_timers
from megatron.training.initialize import initialize_megatron
from megatron.training.log_line import training_log
from megatron.training.model_setup import get_model, print_startup_banner, setup_model_and_optimizer  # noqa: F401
from megatron.training.train_step import get_training_forward_backward_func, train_step
from megatron.training.utils import calc_params_l2_norm, print_rank_0

_TRAIN_START_TIME = time.time()
_STARTUP_TIMESTAMPS = {"program_start": None, "main_entry": None}


def set_startup_timestamps(program_start=None, main_entry=None):
    """Times (time.time()) taken by the entry script: ``program_start`` before its imports becomes the
    start of "time to initialize megatron" and of --exit-duration-in-mins; ``main_entry`` (its
    ``__main__``) is reported on the same line."""
    global _TRAIN_START_TIME
    if program_start is not None:
        _TRAIN_START_TIME = _STARTUP_TIMESTAMPS["program_start"] = program_start
    if main_entry is not None:
        _STARTUP_TIMESTAMPS["main_entry"] = main_entry


def print_datetime(string):
    """Milestone line on rank 0, after a barrier so it marks when every rank got there."""
    torch.distributed.barrier()
    print_rank_0(f"[{string}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')} ")


def pretrain(*args, **kwargs):
    """Everything from flags to the final test evaluation, in either of Megatron's forms:

    - Megatron 0.19: ``pretrain(cfg_container, train_valid_test_dataset_provider, model_type,
      forward_step_func, model_provider=None, ...)`` with a PretrainConfigContainer (see
      `_pretrain_from_container`);
    - classic: ``pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
      process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, ...)``.

    An error on any rank ends the run there with `[rank R] Type: message` and a non-zero exit
    (diagnostics.errors)."""
    if isinstance(args[0] if args else kwargs.get("cfg_container"), PretrainConfigContainer):
        return _pretrain_from_container(*args, **kwargs)
    return _pretrain_classic(*args, **kwargs)


def _pretrain_classic(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                      process_non_loss_data_func=None, extra_args_provider=None, args_defaults={},
                      get_embedding_ranks=None, get_position_embedding_ranks=None, non_loss_data_func=None):
    with report_errors():
        _pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                  process_non_loss_data_func, extra_args_provider, args_defaults, get_embedding_ranks,
                  get_position_embedding_ranks)
    hang.uninstall()  # a finished run stops watching (the process may go on, e.g. in tests)


def _pretrain_from_container(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
                             model_provider=None, process_non_loss_data_func=None, get_embedding_ranks=None,
                             get_position_embedding_ranks=None, non_loss_data_func=None, store=None,
                             inprocess_call_wrapper=None, p2p_communicator=None, pg_collection=None,
                             skip_model_parallel_init=False):
    """Megatron 0.19's pretrain: the flags are those already parsed by parse_and_validate_args (else the
    command line's); ``cfg_container.model`` (a GPTModelConfig), when set, builds the model through its
    builder in place of ``model_provider``. The other sections mirror the flags, which the run reads,
    as Megatron's pretrain does."""
    for name, value in (("store", store), ("inprocess_call_wrapper", inprocess_call_wrapper),
                        ("p2p_communicator", p2p_communicator), ("pg_collection", pg_collection)):
        if value is not None:
            raise NotImplementedError(f"pretrain({name}=...) is not supported; leave it None (default groups)")
    if skip_model_parallel_init:
        raise NotImplementedError("pretrain(skip_model_parallel_init=True) is not supported")
    model_cfg = cfg_container.model
    if model_cfg is not None:
        if model_cfg.pre_wrap_hooks or model_cfg.post_wrap_hooks:
            raise NotImplementedError("pretrain: ModelConfig pre_wrap_hooks / post_wrap_hooks are not supported")
        model_cfg.finalize()
        builder = model_cfg.get_builder_cls()(model_cfg)

        def model_provider(pre_process=True, post_process=True, vp_stage=None):
            return builder.build_model(None, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    elif model_provider is None:
        raise ValueError("pretrain: give cfg_container.model (a GPTModelConfig) or a model_provider")
    with report_errors():
        _pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                  process_non_loss_data_func, None, {}, get_embedding_ranks, get_position_embedding_ranks,
                  parsed_args=global_vars._GLOBAL_ARGS)
    hang.uninstall()


def _pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
              process_non_loss_data_func, extra_args_provider, args_defaults, get_embedding_ranks,
              get_position_embedding_ranks, parsed_args=None):
    if get_embedding_ranks is not None or get_position_embedding_ranks is not None:
        raise NotImplementedError("pretrain(get_embedding_ranks=...) is not supported; use the default ranks")
    start = _STARTUP_TIMESTAMPS["program_start"] or time.time()
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults,
                        parsed_args=parsed_args)
    args = get_args()
    # Restart counter and the previous launch's outcome, next to the checkpoints (diagnostics.launches).
    launches.begin(args)
    try:
        _run(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func, start)
    except SystemExit as e:  # --exit-on-missing-checkpoint, the rerun engine's codes: recorded, then on
        launches.end(f"exited with code {e.code}")
        raise


def _run(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
         process_non_loss_data_func, start):
    args, timers = get_args(), get_timers()
    _initialize_rerun_state_machine(args)
    _report_init_time(start)
    print_datetime("after megatron is initialized")

    timers("model-and-optimizer-setup", log_level=0).start(barrier=True)
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type)
    timers("model-and-optimizer-setup").stop()
    print_startup_banner(model)
    print_datetime("after model, optimizer, and learning rate scheduler are built")
    config = get_model_config(model[0])

    timers("train/valid/test-data-iterators-setup", log_level=0).start(barrier=True)
    train_it, valid_it, test_it = build_iterators_for_model_chunks(train_valid_test_dataset_provider, model)
    timers("train/valid/test-data-iterators-setup").stop()
    print_datetime("after dataloaders are built")
    print_rank_0("done with setup ...")
    timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"], barrier=True)

    iteration, should_exit = args.iteration, False
    progress_log.start_job(args)  # --log-progress
    if not args.skip_train and args.train_iters > 0:
        print_rank_0("training ...")
        print_datetime("before the start of training step")
        iteration, should_exit = train(forward_step_func, model, optimizer, opt_param_scheduler, train_it,
                                       valid_it, process_non_loss_data_func, config)
        print_datetime("after training is done")
        if not should_exit and args.save and iteration != 0 and iteration % args.save_interval != 0:
            _save(iteration, model, optimizer, opt_param_scheduler)
        if args.async_save:
            _finalize_async_saves(blocking=True, terminate=True)
    else:
        print_rank_0("skipping training (--skip-train) ...")
    writer = get_tensorboard_writer()
    if writer is not None:  # every event of the run on disk now, not at interpreter exit (which a kill skips)
        writer.flush()
    if should_exit:
        return
    if valid_it is not None and (args.eval_iters > 0 or args.full_validation):
        evaluate_and_print_results(f"iteration {iteration} on validation set", forward_step_func, valid_it,
                                   model, iteration, process_non_loss_data_func, config, write_to_tensorboard=False)
    if test_it is not None and args.eval_iters > 0:
        evaluate_and_print_results(f"iteration {iteration} on test set", forward_step_func, test_it, model,
                                   iteration, process_non_loss_data_func, config, write_to_tensorboard=False)
    launches.end(f"completed at iteration {iteration}")


def _initialize_rerun_state_machine(args):
    """--rerun-mode and fault injection. A replayed CUDA graph checks its losses itself (train_step) and
    cannot re-run a step, so the machine is disabled there (it would only add a collective per step)."""
    mode = "disabled" if args.cuda_graph_impl == "full_iteration" else args.rerun_mode
    initialize_rerun_state_machine(
        mode=mode, error_injector=RerunErrorInjector(args.error_injection_rate, args.error_injection_type),
        result_rejected_tracker_filename=args.result_rejected_tracker_filename, report_interval=args.log_interval)


def _report_init_time(start):
    t = torch.tensor([start], dtype=torch.float64, device=get_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    print_rank_0("time to initialize megatron (seconds): {:.3f}".format(time.time() - t.item()))
    if _STARTUP_TIMESTAMPS["main_entry"] is not None:
        print_rank_0("time since the entry script's main (seconds): {:.3f}".format(
            time.time() - _STARTUP_TIMESTAMPS["main_entry"]))


def _save(iteration, model, optimizer, opt_param_scheduler, non_persistent=False):
    args, timers = get_args(), get_timers()
    timers("save-checkpoint", log_level=0).start(barrier=True)
    with energy.paused():
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args.num_floating_point_operations_so_far,
                        non_persistent_ckpt=non_persistent)
    timers("save-checkpoint").stop(barrier=True)
    progress_log.saved_checkpoint(args, iteration, asynchronous=args.async_save)  # --log-progress
    timers.log(["save-checkpoint"])


def _setup_config(config, model, optimizer):
    """Hooks the schedule reads from the model config: loss scaling, grad sync, timers."""
    args = get_args()
    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()
    if isinstance(model[0], DDP) and args.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, valid_data_iterator,
          process_non_loss_data_func, config):
    """The loop; returns (last iteration, should_exit) where should_exit means an exit condition fired."""
    args, timers = get_args(), get_timers()
    for chunk in model:
        chunk.train()
    _setup_config(config, model, optimizer)
    total_loss_dict, report_memory_flag = {}, True
    iteration = args.iteration
    forward_backward_func = get_training_forward_backward_func()
    straggler.setup(args)
    get_rerun_state_machine().current_iteration = iteration  # its messages count iterations as the log does
    if get_rerun_state_machine().mode != RerunMode.DISABLED:  # a re-run replays the step's micro-batches
        train_data_iterator = ([RerunDataIterator(it) if it is not None else None for it in train_data_iterator]
                               if isinstance(train_data_iterator, list) else
                               RerunDataIterator(train_data_iterator) if train_data_iterator is not None else None)
    _check_weight_hashes(model, iteration, args)  # the replicas start identical
    test_mode.check_replicas(model, iteration, args, first=True)
    energy.start()
    timers("interval-time", log_level=0).start(barrier=True)
    profiling = ProfilingWindow(args, torch.distributed.get_rank())
    profiling.begin_training()
    save_buffers_reserved = False
    with gc_control.training_gc(args), _finishing(profiling):
        while iteration < args.train_iters:
            hang.heartbeat()
            launches.in_iteration(iteration + 1)
            profiling.before_step(iteration)
            update_num_microbatches(args.consumed_train_samples, consistency_check=True)
            if iteration + 1 in args.iterations_to_skip:  # read and drop its global batch; no step
                iteration = _skip_iteration(train_data_iterator, iteration)
                continue
            straggler.step_start()
            loss_dict, skipped_iter, grad_norm, num_zeros, max_attention_logit = train_step(
                forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config,
                forward_backward_func)
            _maybe_stop_on_failed_validation(iteration, model, optimizer, opt_param_scheduler)
            iteration += 1
            interval = args.check_weight_hash_across_dp_replicas_interval
            if interval and iteration % interval == 0:
                _check_weight_hashes(model, iteration, args)
            if iteration % args.log_interval == 0:
                test_mode.check_replicas(model, iteration, args)
            profiling.after_step(iteration)
            if args.train_sync_interval and iteration % args.train_sync_interval == 0:
                device_synchronize()  # the host waits for the GPU's queue (--train-sync-interval)
            straggler.step_end(iteration, args.log_interval)
            gc_control.after_iteration(args, iteration)
            args.iteration = iteration
            batch_size = args.micro_batch_size * args.data_parallel_size * get_num_microbatches()
            args.consumed_train_samples += batch_size
            args.num_floating_point_operations_so_far += num_floating_point_operations(args, batch_size)
            params_norm = calc_params_l2_norm(model) if args.log_params_norm else None
            report_memory_flag = training_log(
                loss_dict, total_loss_dict, _learning_rate(optimizer), iteration,
                optimizer.get_loss_scale().item(), report_memory_flag, skipped_iter, grad_norm,
                params_norm, num_zeros if args.log_num_zeros_in_grad else None,
                max_attention_logit if args.log_max_attention_logit else None)
            if args.eval_interval and iteration % args.eval_interval == 0 and valid_data_iterator is not None \
                    and (args.start_eval_at_iter is None or iteration >= args.start_eval_at_iter) \
                    and (args.eval_iters > 0 or args.full_validation):
                timers("interval-time").stop()
                gc_control.around_evaluation(args)
                with energy.paused():
                    evaluate_and_print_results(f"iteration {iteration}", forward_step_func, valid_data_iterator,
                                               model, iteration, process_non_loss_data_func, config)
                gc_control.around_evaluation(args, generation=0)
                timers("interval-time").start()
            if args.async_save:
                _finalize_async_saves(blocking=False)
                if not save_buffers_reserved:  # after the first step: the optimizer state exists by now
                    save_buffers_reserved = True
                    reserve_async_save_buffers(model, optimizer, opt_param_scheduler, iteration)
            if args.adlr_autoresume and iteration % args.adlr_autoresume_interval == 0:
                check_adlr_autoresume_termination(iteration, model, optimizer, opt_param_scheduler)
            if _checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration):
                energy.finish()
                return iteration, True
    energy.finish()
    return iteration, False


def _skip_iteration(train_data_iterator, iteration: int) -> int:
    """--iterations-to-skip: the iteration's micro-batches are read (each model chunk's, on the ranks that read
    data) and dropped, the counters move on as after a step; returns the new iteration."""
    args = get_args()
    num_microbatches = get_num_microbatches()
    iterators = train_data_iterator if isinstance(train_data_iterator, list) else [train_data_iterator]
    for it in iterators:
        if it is not None:
            for _ in range(num_microbatches):
                next(it)
    batch_size = args.micro_batch_size * args.data_parallel_size * num_microbatches
    args.consumed_train_samples += batch_size
    args.skipped_train_samples += batch_size
    args.iteration = iteration + 1
    print_rank_0(f" iteration {iteration + 1:8d}/{args.train_iters:8d} | skipped (--iterations-to-skip): "
                 f"{batch_size} samples read and dropped")
    return iteration + 1


def _check_weight_hashes(model, iteration: int, args) -> None:
    """--check-weight-hash-across-dp-replicas-interval (Megatron's): every data-parallel replica holds the same
    weights, at the start of training and every N iterations; otherwise every rank stops with the parameters
    that differ. The parameter all-gathers still in flight (--overlap-param-gather) are waited for first."""
    if not args.check_weight_hash_across_dp_replicas_interval:
        return
    for chunk in model:
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()
    ok, differing = param_hashes_match_across_dp(model)
    if not ok:
        where = f": {', '.join(differing[:5])}{' ...' if len(differing) > 5 else ''}" if differing else \
            " (on other ranks' replica groups)"
        raise RuntimeError(f"--check-weight-hash-across-dp-replicas-interval: parameter hashes differ across "
                           f"data-parallel replicas after {iteration} iterations{where}")
    print_rank_0(f">>> Weight hashes match after {iteration} iterations...")


@contextlib.contextmanager
def _finishing(profiling: ProfilingWindow):
    """The profiling window writes what it recorded however the loop ends (exit condition, error)."""
    try:
        yield
    finally:
        profiling.finish_training()


def _maybe_stop_on_failed_validation(iteration, model, optimizer, opt_param_scheduler):
    """The rerun engine found a transient fault in step iteration+1: save the state before that step
    (when --save) and exit with its code (17), on every rank."""
    should_checkpoint, should_exit, exit_code = get_rerun_state_machine().should_checkpoint_and_exit()
    if not should_exit:
        return
    args = get_args()
    if should_checkpoint and args.save:
        _save(iteration, model, optimizer, opt_param_scheduler)
    print_datetime(f"exiting program: result validation failed at iteration {iteration + 1} "
                   f"(exit code {exit_code})")
    launches.end(f"stopped by the rerun state machine: result validation failed at iteration {iteration + 1} "
                 f"(exit code {exit_code}; see its 'rerun:' log line)")
    sys.exit(exit_code)


def _finalize_async_saves(blocking, terminate=False):
    """Publish background checkpoint saves that finished (all of them when blocking)."""
    maybe_finalize_async_save(blocking=blocking, terminate=terminate)


def _learning_rate(optimizer):
    lr = None
    for group in optimizer.param_groups:
        if len(group["params"]) == 0:
            continue
        if group.get("is_decoupled_lr", False):
            continue
        lr = group["lr"]
    return lr if lr is not None else 0.0


def _checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration):
    """Save at --save-interval; exit on signal, duration or interval (saving first when --save)."""
    args = get_args()
    saved = False
    handler = get_signal_handler()
    if args.exit_signal_handler and handler is not None and handler.signals_received():
        if args.save:
            _save(iteration, model, optimizer, opt_param_scheduler)
        print_datetime(f"exiting program after receiving {args.exit_signal}.")
        launches.end(f"exited after receiving {args.exit_signal} at iteration {iteration}"
                     + (" (checkpoint saved)" if args.save else ""))
        return True
    if args.save and args.save_interval and iteration % args.save_interval == 0:
        _save(iteration, model, optimizer, opt_param_scheduler)
        saved = True
    elif args.save and args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0:
        _save(iteration, model, optimizer, opt_param_scheduler, non_persistent=True)
        saved = True
    if args.exit_duration_in_mins:
        done, minutes = duration_exceeded(_TRAIN_START_TIME, args.exit_duration_in_mins)
        if done:
            if args.save and not saved:
                _save(iteration, model, optimizer, opt_param_scheduler)
            print_datetime(f"exiting program after {minutes} minutes")
            launches.end(f"exited after {minutes:.1f} minutes (--exit-duration-in-mins) at iteration {iteration}")
            return True
    if args.exit_interval and iteration % args.exit_interval == 0:
        if args.save and not saved:
            _save(iteration, model, optimizer, opt_param_scheduler)
        print_datetime(f"exiting program at iteration {iteration}")
        launches.end(f"exited at iteration {iteration} (--exit-interval)")
        return True
    return False
