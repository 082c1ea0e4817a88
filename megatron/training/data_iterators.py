"""Dataset sizes from the run length, datasets from the provider, loaders and iterators."""
import torch

from megatron.core import num_microbatches_calculator, parallel_state
from megatron.core.utils import get_device
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.datasets.full_validation import (
    FullValidationSampler,
    PaddedValidationSet,
    full_validation_steps,
)
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0


def train_valid_test_num_samples():
    """(train, valid, test) sample counts, as Megatron computes them."""
    args = get_args()
    train = args.train_samples
    if train is None:
        train = args.train_iters * args.global_batch_size
        if args.step_batch_size_schedule is not None:  # the batch size steps: what the iterations consume
            train = num_microbatches_calculator._calculator().samples_after(args.train_iters)
    evals = args.eval_iters
    if args.eval_interval and not args.skip_train:
        points = args.train_iters // args.eval_interval + 1
        if getattr(args, "start_eval_at_iter", None) is not None:  # the evaluations before it do not happen
            points = max(0, points - args.start_eval_at_iter // args.eval_interval)
        evals = points * args.eval_iters
    eval_batch = _eval_global_batch_size(args)
    # --full-validation: one epoch of the validation set(s), whatever --eval-iters says.
    valid = None if getattr(args, "full_validation", False) else evals * eval_batch
    return train, valid, args.eval_iters * eval_batch


def _eval_global_batch_size(args) -> int:
    return getattr(args, "eval_global_batch_size", None) or args.global_batch_size


def _none_if_empty(dataset):
    """An evaluation split of 0 samples (--eval-iters 0 with BERT/T5 data) has no loader, as in Megatron."""
    try:
        return None if dataset is not None and len(dataset) == 0 else dataset
    except TypeError:  # an iterable without a length
        return dataset


def _cyclic_iter(loader):
    while True:
        for batch in loader:
            yield batch


def _iterator(loader, cyclic):
    if loader is None:
        return None
    return iter(_cyclic_iter(loader)) if cyclic else iter(loader)


def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
    """Iterators on ranks that read data (TP rank 0, or all ranks for `is_distributed` providers)."""
    args = get_args()
    print_rank_0("> building train, validation, and test datasets ...")
    if args.iteration > 0 and args.consumed_train_samples == 0:
        args.consumed_train_samples = args.iteration * args.global_batch_size
    if args.iteration > 0 and args.consumed_valid_samples == 0 and args.eval_interval:
        skipped = (getattr(args, "start_eval_at_iter", None) or 0) // args.eval_interval
        args.consumed_valid_samples = (max(0, args.iteration // args.eval_interval - skipped) * args.eval_iters
                                       * _eval_global_batch_size(args))
    sizes = train_valid_test_num_samples()
    print_rank_0(" > datasets target sizes (minimum size):")
    print_rank_0("    train:      {}".format(sizes[0]))
    print_rank_0("    validation: {}".format(sizes[1]))
    print_rank_0("    test:       {}".format(sizes[2]))
    reads = (getattr(build_train_valid_test_datasets_provider, "is_distributed", False)
             or parallel_state.get_tensor_model_parallel_rank() == 0)
    loaders = (None, None, None)
    sets = _validation_set_names(args)
    valid_loaders, steps = [None] * len(sets), [0] * len(sets)
    if reads:
        train_ds, valid_ds, test_ds = build_train_valid_test_datasets_provider(list(sizes))
        if getattr(args, "full_validation", False):
            valid_loaders, steps = _full_validation_loaders(args, valid_ds, len(sets))
            valid_loader = valid_loaders[0]
        else:
            valid_loader = build_pretraining_data_loader(_none_if_empty(valid_ds), args.consumed_valid_samples,
                                                         micro_batch_size=getattr(args, "eval_micro_batch_size", None))
        loaders = (build_pretraining_data_loader(train_ds, args.consumed_train_samples), valid_loader,
                   build_pretraining_data_loader(_none_if_empty(test_ds), 0,
                                                 micro_batch_size=getattr(args, "eval_micro_batch_size", None)))
    flags = torch.tensor([int(l is not None) for l in loaders], dtype=torch.long, device=get_device())
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    args.do_train, args.do_valid, args.do_test = (bool(f) and args.train_iters > 0 if i == 0 else bool(f)
                                                  for i, f in enumerate(flags.tolist()))
    cyclic = args.dataloader_type == "cyclic"
    train_it = _iterator(loaders[0], cyclic)
    valid_it = _iterator(loaders[1], True)  # validation passes may revisit the set
    test_it = _iterator(loaders[2], True)
    # Ranks that get batches by broadcast (TP > 0, middle PP stages) still run the evaluation schedule.
    if valid_it is None and args.do_valid:
        valid_it = _BroadcastFed()
    if test_it is None and args.do_test:
        test_it = _BroadcastFed()
    if getattr(args, "full_validation", False):
        # Every rank runs the same steps per set, also those that read no data (TP > 0, middle PP stages).
        counts = torch.tensor(steps, dtype=torch.long, device=get_device())
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
        iterators = [_iterator(loader, True) if loader is not None else (_BroadcastFed() if args.do_valid else None)
                     for loader in valid_loaders]
        valid_it = ValidationSets(sets, iterators, counts.tolist()) if args.do_valid else None
    return train_it, valid_it, test_it


def _validation_set_names(args):
    """The loss-line suffix of each validation set: '' for the one set, '-<name>' or '-<index>' for several."""
    if not getattr(args, "multiple_validation_sets", False):
        return [""]
    names = args.validation_set_names or [str(i) for i in range(len(args.valid_data_path))]
    return [f"-{name}" for name in names]


def _full_validation_loaders(args, valid_ds, num_sets):
    """(loaders, steps per set): each set whole, padded to whole evaluation steps on every DP rank."""
    datasets = valid_ds if isinstance(valid_ds, list) else [valid_ds]
    if len(datasets) != num_sets:
        raise ValueError(f"--multiple-validation-sets: the data provider built {len(datasets)} validation sets for "
                         f"{num_sets} --valid-data-path prefixes")
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mbs = getattr(args, "eval_micro_batch_size", None) or args.micro_batch_size
    num_microbatches = _eval_global_batch_size(args) // (mbs * dp_size)
    loaders, steps = [], []
    for dataset in datasets:
        if dataset is None:
            loaders.append(None)
            steps.append(0)
            continue
        count = full_validation_steps(len(dataset), mbs, dp_size, num_microbatches)
        sampler = FullValidationSampler(len(dataset), mbs, dp_rank, dp_size, num_microbatches, count)
        loaders.append(build_pretraining_data_loader(PaddedValidationSet(dataset), 0, batch_sampler=sampler))
        steps.append(count)
    return loaders, steps


class ValidationSets:
    """The validation iterators of --full-validation / --multiple-validation-sets: per set its loss-line suffix,
    its iterator (a list of one per model chunk with virtual pipeline stages) and its evaluation steps."""

    def __init__(self, suffixes, iterators, steps):
        self.suffixes, self.iterators, self.steps = list(suffixes), list(iterators), list(steps)

    def __iter__(self):
        return iter(zip(self.suffixes, self.iterators, self.steps))

    @classmethod
    def per_chunk(cls, chunks):
        """One ValidationSets from each model chunk's: the iterators become per-chunk lists."""
        first = chunks[0]
        return cls(first.suffixes, [list(its) for its in zip(*(c.iterators for c in chunks))], first.steps)


class _BroadcastFed:
    """Iterator stand-in on ranks that receive batches by broadcast (get_batch ignores it)."""

    def __iter__(self):
        return self

    def __next__(self):
        return None


def build_iterators_for_model_chunks(provider, model):
    """(train, valid, test) iterators as the schedule takes them: one each without virtual pipeline stages,
    else a list with one per model chunk (each chunk reads its own copy: the first tokens, the last labels)."""
    if get_args().virtual_pipeline_model_parallel_size is None:
        return build_train_valid_test_data_iterators(provider)
    per_chunk = [build_train_valid_test_data_iterators(provider) for _ in model]
    out = [[its[i] for its in per_chunk] for i in range(3)]
    if isinstance(out[1][0], ValidationSets):
        out[1] = ValidationSets.per_chunk(out[1])
    return tuple(out)


get_train_valid_test_num_samples = train_valid_test_num_samples  # Megatron's name (megatron.training)
