"""`pretrain_gpt.py --use-precision-aware-optimizer` through pretrain() (--bf16, the distributed optimizer, bf16
gradients and moments; mock data): the flags reach the optimizer (a bf16 grad buffer, bf16 moments) and the loss
follows the run with the default fp32 state within 1%."""
from tests.fixtures.tiny_gpt import run_pretrain
from tests.parallel.dist_utils import run_distributed

CMD = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
       "--micro-batch-size 2 --global-batch-size 8 --train-iters 12 --lr 3e-3 --lr-warmup-iters 2 --mock-data "
       "--tokenizer-type NullTokenizer --vocab-size 512 --log-interval 1 --eval-iters 0 --num-workers 0 --bf16 "
       "--use-distributed-optimizer")
LOW = "--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"


def _train(extra):
    losses, dtypes = [], set()

    def on_step(model, optimizer, result):
        losses.append(float(result[0]["lm loss"]))
        dtypes.update(t.dtype for s in optimizer.optimizer.state.values() for k, t in s.items() if k != "step")
        dtypes.update(b.grad_data.dtype for chunk in model for b in chunk.buffers)
    run_pretrain((CMD + " " + extra).split(), on_step=on_step)
    return losses, {str(d).replace("torch.", "") for d in dtypes}


def test_bf16_state_trains_like_fp32_state():
    (fp32, fp32_dtypes), (low, low_dtypes) = (run_distributed(_train, 1, extra)[0] for extra in ("", LOW))
    assert fp32_dtypes == {"float32"} and low_dtypes == {"bfloat16"}
    assert len(low) == 12 and low[-1] < 0.9 * low[0], low
    assert abs(low[-1] - fp32[-1]) < 0.01 * fp32[-1], (low, fp32)
