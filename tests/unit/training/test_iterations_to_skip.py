"""--iterations-to-skip and --train-sync-interval through pretrain(): a skipped iteration's global batch is read
and dropped (the next iteration trains on the batch after it, as in the run without skips), no step is taken, the
samples are counted as consumed and skipped; the host waits for the device every N iterations."""
from tests.fixtures.tiny_gpt import run_pretrain
from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --tokenizer-type NullTokenizer --mock-data --lr 1e-3 --log-interval 1 --eval-iters 0 "
         "--eval-interval 1000 --num-workers 0 --global-batch-size 4 --micro-batch-size 2 --train-iters 4")


def _batches_and_log(extra):
    """The first tokens of every micro-batch training read, the steps taken, the log and the sync count."""
    import pretrain_gpt
    from megatron.training import training
    seen, steps, syncs = [], [], []
    get_batch, sync = pretrain_gpt.get_batch, training.device_synchronize

    def recording_get_batch(data_iterator, vp_stage=None):
        batch = get_batch(data_iterator, vp_stage)
        seen.append(batch[0][:, :4].tolist())
        return batch

    pretrain_gpt.get_batch, training.device_synchronize = recording_get_batch, lambda: syncs.append(1)
    try:
        log = run_pretrain((MODEL + " " + extra).split(), on_step=lambda *a: steps.append(1), capture_stdout=True)
    finally:
        pretrain_gpt.get_batch, training.device_synchronize = get_batch, sync
    return seen, len(steps), log, len(syncs)


def test_a_skipped_iteration_drops_its_batch_and_takes_no_step():
    (plain, plain_steps, _, syncs), (skip, skip_steps, log, _) = [
        run_distributed(_batches_and_log, 1, extra)[0] for extra in ("--train-sync-interval 2",
                                                                     "--iterations-to-skip 2")]
    assert plain_steps == 4 and skip_steps == 3 and syncs == 2
    assert len(plain) == 8 and skip == plain[:2] + plain[4:]  # iteration 2's two micro-batches were dropped
    assert "skipped (--iterations-to-skip): 4 samples read and dropped" in log
    last = [line for line in log.splitlines() if "iteration        4/" in line][-1]
    assert "consumed samples:           16" in last and "skipped samples:            4" in last, last
