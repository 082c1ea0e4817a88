"""Python's cyclic garbage collector around the training loop.

Always: before the first iteration everything alive (imported modules, model, optimizer, datasets) is
collected once and frozen into the permanent generation, so the collections that the loop's allocations
trigger walk only objects made during training (a full collection over the ~10^6 startup objects pauses
the host for milliseconds while the GPU drains); unfrozen again when the loop ends, so nothing made
before it is kept past its life. ``--manual-gc`` (Megatron's flag) also turns the automatic collector off
for the loop and collects every ``--manual-gc-interval`` iterations (0: never) and, unless
``--no-manual-gc-eval``, around each evaluation: the same iterations on every rank, so no rank stalls
the others at a collective.
"""
import contextlib
import gc


@contextlib.contextmanager
def training_gc(args):
    manual = bool(args.manual_gc)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    if manual:
        gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if manual and was_enabled:
            gc.enable()


def after_iteration(args, iteration: int):
    interval = args.manual_gc_interval or 0
    if args.manual_gc and interval > 0 and iteration % interval == 0:
        gc.collect()


def around_evaluation(args, generation: int = 2):
    """Before an evaluation a full collection, after it the young generation (Megatron's choice)."""
    if args.manual_gc and args.manual_gc_eval:
        gc.collect(generation)
