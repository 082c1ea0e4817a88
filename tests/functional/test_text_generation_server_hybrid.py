"""The text generation server over a hybrid checkpoint trained by pretrain_hybrid.py (Mamba-2, attention, Gated
DeltaNet and MLP layers): --use-checkpoint-args rebuilds the hybrid model, /api and /completions answer, and
requests decoded together (their recurrent states in neighbouring slots) get their alone answers."""
import os
import threading

import pytest

from tests.functional.test_text_generation_server import TOKENIZER, _call, _run, _start_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = ("--hybrid-layer-pattern M*G- --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 64 --position-embedding-type rope --normalization RMSNorm --swiglu "
         "--disable-bias-linear --mamba-state-dim 8 --mamba-head-dim 8 --mamba-num-groups 2 --linear-key-head-dim 8 "
         "--linear-value-head-dim 8 --linear-num-key-heads 2 --linear-num-value-heads 4 --micro-batch-size 2 "
         "--global-batch-size 2 --train-iters 2 --lr 1e-3 --mock-data --eval-iters 0 --num-workers 0 "
         "--save-interval 2").split() + TOKENIZER


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("genhybrid") / "ckpt")
    _run(os.path.join(ROOT, "pretrain_hybrid.py"), *TRAIN, "--save", path)
    log_path = os.path.join(os.path.dirname(path), "server.log")
    started = None
    for _ in range(3):
        started = _start_server(path, log_path)
        if started is not None:
            break
    assert started is not None, "three free ports were taken before the server bound them"
    proc, url = started
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_hybrid_server_completes_and_batches_requests(server):
    status, out = _call(server, "/completions", {"prompt": "The cat", "max_tokens": 5, "temperature": 0},
                        method="POST")
    assert status == 200, out
    api = _call(server, "/api", {"prompts": ["The cat"], "tokens_to_generate": 5, "top_k": 1})[1]
    assert "The cat" + out["choices"][0]["text"] == api["text"][0] and len(api["tokens"][0]) > 2
    # Prompts of different lengths: alone, then all at once (one padded prefill, shared decode steps).
    bodies = [{"prompts": [w], "tokens_to_generate": 8 + 2 * i, "top_k": 1}
              for i, w in enumerate(["The", "A cat sat on the mat", "Once upon a time", "Hello"])]
    alone = [_call(server, "/api", b)[1]["tokens"] for b in bodies]
    together = [None] * len(bodies)

    def client(i):
        together[i] = _call(server, "/api", bodies[i])[1]["tokens"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
