"""Re-run a training step whose result looks wrong (NaN/Inf, spiky loss, large grads) to tell a transient
fault (the re-run differs: suspect the hardware) from a reproducible one (the data or the model).

Usage in a training step (Megatron's names):

    rsm = get_rerun_state_machine()
    while rsm.should_run_forward_backward(data_iterator):   # once, or twice when a result was rejected
        ... forward/backward; loss_func calls rsm.validate_result(loss, torch.isnan, "NaN in loss", fatal=True)
    should_checkpoint, should_exit, exit_code = rsm.should_checkpoint_and_exit()
    if rsm.should_skip_step(): ... no optimizer step

Decisions (modes from --rerun-mode):
- validate_results: a rejected result re-runs the step in place (RNG states restored, same micro-batches
  replayed by RerunDataIterator). A fatal check (NaN/Inf) whose re-run is clean or different is a transient
  fault: STOP, saving a checkpoint, exit code 17 (Megatron's EXIT_CODE_FAILED_ON_RESULT_VALIDATION). One
  that reproduces comes from the data or the model: SKIP the step (no optimizer update). Megatron instead
  exits with 16 to re-run on another GPU; in one process the device cannot change, so we take the
  conclusion its second re-run would reach. Non-fatal checks (spiky loss, large grads) REPORT and go on
  with the re-run's result.
- report_stats: every step runs twice; the largest relative difference per check is logged (a measure of
  non-determinism). Fatal results still stop the run.
- disabled: no re-runs; a fatal result stops the run (RuntimeError), a non-fatal one is reported.
Results validated inside the step loop are judged when its pass ends, all in one device transfer (no host
synchronisation per micro-batch), before the step's update. Every decision is logged on the rank that saw
the result, appended to --result-rejected-tracker-filename, and kept in `state_dict()`, which checkpoints save.

Fault injection (--error-injection-rate N, --error-injection-type): every Nth validated result of an
initial run is made NaN in place (a real fault: the backward and the optimizer see it); a persistent or
correct_result injection repeats on the re-run, a transient one does not.
"""
import logging
import math
import os
import random
import socket
from enum import Enum

import numpy as np
import torch

from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

logger = logging.getLogger(__name__)

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17

_GLOBAL_RERUN_STATE_MACHINE = None


class RerunDiagnostic(str, Enum):
    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunMode(str, Enum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_stats"


class RerunState(Enum):
    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2


def _rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class RerunErrorInjector:
    """Makes every ``error_injection_rate``-th validated result of an initial run NaN (0: never)."""

    def __init__(self, error_injection_rate=0, error_injection_type=RerunDiagnostic.TRANSIENT_ERROR):
        self.rate, self.type = error_injection_rate, RerunDiagnostic(error_injection_type)
        self.count, self.injected_call = 0, None

    def should_inject(self, state, call):
        if not self.rate:
            return False
        if state == RerunState.INITIAL_RUN:
            self.count += 1
            if self.count % self.rate == 0:
                self.injected_call = call
                return True
            return False
        return call == self.injected_call and self.type != RerunDiagnostic.TRANSIENT_ERROR

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state.get("count", 0)


class RerunDataIterator:
    """Wraps a data iterator so a step's micro-batches can be replayed: `advance` starts a step, `rewind`
    replays what the step has read so far."""

    def __init__(self, iterable):
        self.iterable = iterable
        self.saved, self.replay = [], None

    def __iter__(self):
        return self

    def __next__(self):
        if self.replay:
            return self.replay.pop(0)
        item = next(self.iterable)
        self.saved.append(item)
        return item

    def advance(self):
        self.saved, self.replay = [], None

    def rewind(self):
        self.replay = list(self.saved)


def _compare_floats(a, b):
    a, b = float(a), float(b)
    if math.isnan(a) and math.isnan(b) or a == b:
        return 0.0
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


class RerunStateMachine:
    def __init__(self, mode=RerunMode.DISABLED, error_injector=None, result_rejected_tracker_filename=None,
                 state_save_func=None, state_restore_func=None, report_interval=2):
        self.mode = RerunMode(mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.error_injector = error_injector or RerunErrorInjector()
        self.tracker_filename = result_rejected_tracker_filename
        if self.tracker_filename is not None:
            with open(self.tracker_filename, "a"):
                pass  # fail now, not at the first rejected result, if it cannot be written
        self.state_save_func, self.state_restore_func = state_save_func, state_restore_func
        self.report_interval = report_interval
        self.current_iteration = -1
        self.decisions = []  # one record per rejected result: kept in checkpoints
        self.large_value_counts, self.max_values = {}, {}
        self.stats = {}  # report_stats: message -> [count, max relative difference]
        self._reset_step()

    def _reset_step(self):
        self.validation_counts = {}
        self.rerun_requested = self.stop_requested = self.skip_requested = False
        self.failed_call, self.initial_result, self.fatal = None, None, True
        self.saved_results = {}
        self.saved_state = None
        self.pending = []  # (call, message, fatal, result, rejection function) judged at the step's end

    # --- the step loop -------------------------------------------------------------------------------
    def should_run_forward_backward(self, data_iterator):
        """True to (re)run the step's forward/backward; see the module docstring."""
        iterators = [d for d in (data_iterator if isinstance(data_iterator, list) else [data_iterator])
                     if isinstance(d, RerunDataIterator)]
        self.validation_counts = {}
        if self.state == RerunState.NOT_RUNNING_YET:
            self._reset_step()
            self.current_iteration += 1
            self.state = RerunState.INITIAL_RUN
            if self.mode != RerunMode.DISABLED:
                self._save_state()
                for d in iterators:
                    d.advance()
            return True
        if self.state == RerunState.INITIAL_RUN:
            try:
                self._judge_pending()
            except RuntimeError:
                self.state = RerunState.NOT_RUNNING_YET  # a fatal result with re-runs disabled: the run stops
                raise
            if self.mode == RerunMode.DISABLED or not self._reduce_any(self.rerun_requested):
                self.state = RerunState.NOT_RUNNING_YET
                return False
            if _rank() == 0:
                logger.warning("re-running iteration %d to check whether its result reproduces", self.current_iteration)
            self.state = RerunState.RERUNNING_IN_PLACE
            self._restore_state()
            for d in iterators:
                d.rewind()
            return True
        # After the re-run: every rank learns what any rank decided.
        self.stop_requested, self.skip_requested = self._reduce_any([self.stop_requested, self.skip_requested])
        if self.stop_requested:
            # The checkpoint saved before the exit holds the state at the start of the failed step (RNG and
            # data position, as Megatron), so a restarted job runs that step exactly as the first try did.
            self._restore_state()
            for d in iterators:
                d.rewind()
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            self._maybe_report_stats()
        self.state = RerunState.NOT_RUNNING_YET
        return False

    def should_checkpoint_and_exit(self):
        """(save a checkpoint, exit, exit code) after the step's forward/backward runs."""
        if self.stop_requested:
            return True, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        return False, False, 0

    def should_skip_step(self):
        """The step's result was reproducibly bad: do not apply its update."""
        return self.skip_requested

    # --- validation -------------------------------------------------------------------------------------
    def validate_result(self, result, rejection_func, message, comparison_func=None, tolerance=0.0, fatal=True):
        """Check ``result`` (a 0-dim tensor); in validate_results mode a rejection triggers a re-run."""
        call = (message, self.validation_counts.setdefault(message, 0) + 1)
        self.validation_counts[message] += 1
        if self.error_injector.should_inject(self.state, call):
            with torch.no_grad():
                result.mul_(float("nan"))
        comparison_func = comparison_func or _compare_floats
        if self.mode == RerunMode.DISABLED or self.state == RerunState.NOT_RUNNING_YET:
            if self.state == RerunState.INITIAL_RUN and self._defer(call, message, fatal, result, rejection_func):
                return
            if rejection_func(result):
                self._rejected_without_rerun(message, result, fatal)
            return
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            self._record_stats(call, result, comparison_func, rejection_func, message, fatal)
            return
        if self.state == RerunState.INITIAL_RUN:
            if self.rerun_requested or self._defer(call, message, fatal, result, rejection_func):
                return
            if rejection_func(result):
                self._request_rerun(call, message, fatal, float(result))
        elif call == self.failed_call:
            reproduced = rejection_func(result) and comparison_func(self.initial_result, result) <= tolerance
            if reproduced:
                self._decide(message, self.initial_result, float(result), RerunDiagnostic.PERSISTENT_ERROR.value,
                             "skip" if fatal else "report", fatal)
            else:
                self._decide(message, self.initial_result, float(result), RerunDiagnostic.TRANSIENT_ERROR.value,
                             "stop" if fatal else "report", fatal)

    # A result checked inside the step loop is judged when the step's forward/backward has run, not when it
    # is computed: reading a device tensor on the spot is a host synchronisation per check (the loss's NaN and
    # Inf checks: two per micro-batch; the gradient buckets': two per bucket), which stops the host from
    # queueing work ahead of the GPU. The results wait on the device (no kernel per check) and come back in
    # one transfer at the step's end, before any optimizer update; the rejection functions then run on them
    # in call order, so the decisions are those an immediate check would make. A deferred result must not be
    # changed in place before then (error injection's in-place NaN is queued before the transfer).
    def _defer(self, call, message, fatal, result, rejection_func):
        if not isinstance(result, torch.Tensor) or result.numel() != 1:
            return False
        self.pending.append((call, message, fatal, result.detach(), rejection_func))
        return True

    def _judge_pending(self):
        pending, self.pending = self.pending, []
        if not pending:
            return
        values = [p[3].reshape(()).float() for p in pending]
        try:
            values = torch.stack(values).cpu()
        except RuntimeError:  # results on several devices
            values = torch.stack([v.cpu() for v in values])
        for (call, message, fatal, _, rejection_func), value in zip(pending, values):
            if not rejection_func(value):
                continue
            if self.mode == RerunMode.DISABLED:
                self._rejected_without_rerun(message, float(value), fatal)
            elif not self.rerun_requested:
                self._request_rerun(call, message, fatal, float(value))

    def _rejected_without_rerun(self, message, result, fatal):
        self._decide(message, result, None, "rejected, no re-run (--rerun-mode disabled)",
                     "stop" if fatal else "report", fatal)

    def _request_rerun(self, call, message, fatal, value):
        self.rerun_requested, self.failed_call, self.fatal = True, call, fatal
        self.initial_result = value
        logger.error("rank %d: unexpected result %s at iteration %d (%s); the step will be re-run",
                     _rank(), self.initial_result, self.current_iteration, message)

    def _decide(self, message, initial, rerun, diagnosis, decision, fatal):
        record = {"iteration": self.current_iteration, "rank": _rank(), "node": socket.gethostname(),
                  "message": message, "initial_result": initial if rerun is not None else float(initial),
                  "rerun_result": rerun, "diagnosis": diagnosis, "decision": decision}
        self.decisions.append(record)
        self._append_to_tracker(record)
        what = {"stop": "stopping the run", "skip": "skipping the step (no optimizer update)",
                "report": "continuing"}[decision]
        line = (f"rerun: rank {record['rank']} iteration {self.current_iteration}: {message}: result "
                f"{record['initial_result']}" + (f", re-run {rerun}" if rerun is not None else "")
                + f" -> {diagnosis}; {what}")
        print(line, flush=True)
        if decision == "stop" and (self.mode == RerunMode.DISABLED or self.state == RerunState.NOT_RUNNING_YET
                                   or self.mode == RerunMode.REPORT_DETERMINISM_STATS):
            raise RuntimeError(f"Rank {_rank()}, node {socket.gethostname()}, iteration {self.current_iteration}: "
                               f"unexpected result {initial} ({message}); lower --lr or use --bf16, or pass "
                               "--no-check-for-nan-in-loss-and-grad")
        self.stop_requested |= decision == "stop"
        self.skip_requested |= decision == "skip"

    def is_unexpectedly_large(self, result, threshold, context, num_samples=100, resample=False):
        """Rejection function: |result| >= threshold x the largest of the first ``num_samples`` values."""
        value = math.fabs(float(result))
        if math.isnan(value) or math.isinf(value):
            return False  # NaN/Inf have their own checks
        if resample or context not in self.large_value_counts:
            self.large_value_counts[context], self.max_values[context] = 0, 0.0
        if self.large_value_counts[context] < num_samples:
            self.large_value_counts[context] += 1
            self.max_values[context] = max(self.max_values[context], value)
            return False
        return value >= self.max_values[context] * threshold

    # --- report_stats --------------------------------------------------------------------------------------
    def _record_stats(self, call, result, comparison_func, rejection_func, message, fatal):
        if fatal and rejection_func(result):
            self._decide(message, float(result), None, "rejected while reporting stats", "stop", fatal)
        if self.state == RerunState.INITIAL_RUN:
            self.rerun_requested = True
            self.saved_results[call] = float(result)
        elif call in self.saved_results:
            diff = comparison_func(self.saved_results[call], result)
            count, worst = self.stats.get(message, (0, 0.0))
            self.stats[message] = (count + 1, max(worst, diff))

    def _maybe_report_stats(self):
        if (self.current_iteration + 1) % self.report_interval or not self.stats:
            return
        parts = [f"{m}: max relative difference {worst:.3g} over {n} re-runs" for m, (n, worst) in
                 sorted(self.stats.items())]
        print(f"rerun stats (rank {_rank()}, iteration {self.current_iteration}): " + "; ".join(parts), flush=True)

    # --- state ---------------------------------------------------------------------------------------------
    def _save_state(self):
        self.saved_state = {"random": random.getstate(), "numpy": np.random.get_state(),
                            "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
                            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available()
                            and torch.cuda.is_initialized() else None,
                            "other": self.state_save_func() if self.state_save_func else None}

    def _restore_state(self):
        s = self.saved_state
        random.setstate(s["random"])
        np.random.set_state(s["numpy"])
        torch.set_rng_state(s["torch"])
        get_cuda_rng_tracker().set_states(s["tracker"])
        if s["cuda"] is not None:
            torch.cuda.set_rng_state(s["cuda"])
        if s["other"] is not None and self.state_restore_func:
            self.state_restore_func(s["other"])

    def _reduce_any(self, value):
        values = value if isinstance(value, list) else [value]
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            out = [bool(v) for v in values]
        else:
            device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
            flags = torch.tensor([int(v) for v in values], dtype=torch.int32, device=device)
            torch.distributed.all_reduce(flags)
            out = [bool(v) for v in flags.tolist()]
        return out if isinstance(value, list) else out[0]

    def _append_to_tracker(self, record):
        if self.tracker_filename is None:
            return
        with open(self.tracker_filename, "a") as f:
            f.write(" ".join(f"{k}={record[k]}" for k in ("iteration", "rank", "node", "diagnosis", "decision",
                                                          "initial_result", "rerun_result"))
                    + f" jobID={os.environ.get('SLURM_JOB_ID', 'N/A')} message='{record['message']}'\n")

    def state_dict(self):
        """What checkpoints keep: the mode, every decision so far, the spike detectors' maxima."""
        return {"mode": self.mode.value, "current_iteration": self.current_iteration,
                "decisions": list(self.decisions), "error_injector": self.error_injector.state_dict(),
                "large_value_counts": dict(self.large_value_counts), "max_values": dict(self.max_values)}

    def load_state_dict(self, state):
        self.current_iteration = state.get("current_iteration", self.current_iteration)
        self.decisions = list(state.get("decisions", []))
        self.error_injector.load_state_dict(state.get("error_injector", {}))
        self.large_value_counts = dict(state.get("large_value_counts", {}))
        self.max_values = dict(state.get("max_values", {}))


def initialize_rerun_state_machine(**kwargs):
    global _GLOBAL_RERUN_STATE_MACHINE
    _GLOBAL_RERUN_STATE_MACHINE = RerunStateMachine(**kwargs)
    return _GLOBAL_RERUN_STATE_MACHINE


def get_rerun_state_machine():
    """The process's machine; a disabled one when training did not set one up (library use, tests)."""
    global _GLOBAL_RERUN_STATE_MACHINE
    if _GLOBAL_RERUN_STATE_MACHINE is None:
        _GLOBAL_RERUN_STATE_MACHINE = RerunStateMachine()
    return _GLOBAL_RERUN_STATE_MACHINE


def destroy_rerun_state_machine():
    global _GLOBAL_RERUN_STATE_MACHINE
    _GLOBAL_RERUN_STATE_MACHINE = None
