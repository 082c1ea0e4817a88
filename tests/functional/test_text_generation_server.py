"""The real text generation server (tools/run_text_generation_server.py) on a free localhost port, over a
checkpoint trained by pretrain_gpt.py: good and bad HTTP requests, OpenAI completions, seeded sampling,
8 concurrent clients each getting their alone answer (tools/generate.py: test_generation_hf.py)."""
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.parallel.dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(ROOT, "data", "vocab.json"),
             "--merge-file", os.path.join(ROOT, "data", "merges.txt")]
TRAIN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
         "--micro-batch-size 2 --global-batch-size 2 --train-iters 2 --lr 1e-3 --mock-data --eval-iters 0 "
         "--num-workers 0 --save-interval 2").split() + TOKENIZER
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def _run(*cmd):
    p = subprocess.run([sys.executable] + list(cmd), capture_output=True, text=True, timeout=240, cwd=ROOT, env=ENV)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gen") / "ckpt")
    _run(os.path.join(ROOT, "pretrain_gpt.py"), *TRAIN, "--save", path)
    return path


def _start_server(checkpoint, log_path):
    """(process, url) of a server that answers, or None when its port was taken before it bound it (a free
    port is only free when picked; parallel test workers start processes too)."""
    port = free_port()
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would block the server's prints
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "run_text_generation_server.py"),
                                 "--load", checkpoint, "--use-checkpoint-args", *TOKENIZER, "--port", str(port)],
                                cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        if proc.poll() is not None:
            text = open(log_path).read()
            if "Address already in use" in text:
                return None
            raise AssertionError(f"server exited: {text[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.25)
    proc.terminate()
    raise AssertionError("server did not come up in 60 s")


@pytest.fixture(scope="module")
def server(checkpoint):
    log_path = os.path.join(os.path.dirname(checkpoint), "server.log")
    started = None
    for _ in range(3):
        started = _start_server(checkpoint, log_path)
        if started is not None:
            break
    assert started is not None, "three free ports were taken before the server bound them"
    proc, url = started
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _call(url, path, body, method="PUT"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_api_good_and_bad_requests(server):
    status, out = _call(server, "/api", {"prompts": ["Hello world", "The cat"], "tokens_to_generate": 6,
                                         "logprobs": True, "top_k": 1})
    assert status == 200, out
    for prompt, text, tokens, segs, lps in zip(["Hello world", "The cat"], out["text"], out["tokens"],
                                                out["segments"], out["logprobs"]):
        assert text.startswith(prompt) and len(text) > len(prompt)
        assert len(tokens) == len(segs) == len(lps) + 1
        assert all(lp <= 0 for lp in lps)
    bad = [
        ({"tokens_to_generate": 4}, "prompts argument required"),
        ({"prompts": "Hello"}, "not a list of strings"),
        ({"prompts": []}, "prompts is empty"),
        ({"prompts": ["Hi"], "tokens_to_generate": -1}, "tokens_to_generate"),
        ({"prompts": ["Hi"], "tokens_to_generate": "5"}, "tokens_to_generate"),
        ({"prompts": ["Hi"], "tokens_to_generate": 0}, "logprobs"),
        ({"prompts": ["Hi"], "temperature": "hot"}, "temperature"),
        ({"prompts": ["Hi"], "top_k": 5, "top_p": 0.5}, "both top_k and top_p"),
        ({"prompts": ["Hi"], "logprobs": "yes"}, "logprobs"),
        ({"prompts": [""]}, "add_BOS"),
        ({"prompts": ["word " * 70], "tokens_to_generate": 1}, "exceeds the context"),
        ({"prompts": ["Hi"], "tokens_to_generate": 63}, "exceeds the context"),
        ({"prompts": ["Hi"], "beam_width": 2}, "not supported"),
        (b"{not json", "not valid JSON"),
    ]
    for body, reason in bad:
        status, out = _call(server, "/api", body)
        assert status == 400 and reason in out["message"], (body, status, out)
    assert _call(server, "/nowhere", {"prompts": ["Hi"]})[0] == 404
    # Still serving, and greedy is deterministic: the same request gives the same answer.
    greedy = {"prompts": ["The cat"], "tokens_to_generate": 6, "top_k": 1}
    assert _call(server, "/api", greedy)[1]["text"] == _call(server, "/api", greedy)[1]["text"]
    seeded = {"prompts": ["The cat"], "tokens_to_generate": 8, "temperature": 1.0, "top_k": 0, "random_seed": 3}
    assert _call(server, "/api", seeded)[1]["tokens"] == _call(server, "/api", seeded)[1]["tokens"]


def test_completions_endpoint(server):
    status, out = _call(server, "/completions", {"prompt": "The cat", "max_tokens": 5, "temperature": 0,
                                                 "logprobs": 1}, method="POST")
    assert status == 200, out
    choice = out["choices"][0]
    api = _call(server, "/api", {"prompts": ["The cat"], "tokens_to_generate": 5, "top_k": 1})[1]
    assert "The cat" + choice["text"] == api["text"][0]  # same greedy continuation on both endpoints
    assert out["usage"]["completion_tokens"] == len(choice["logprobs"]["tokens"]) <= 5
    status, echo = _call(server, "/v1/completions", {"prompt": [[464, 3797]], "max_tokens": 0, "echo": True,
                                                     "logprobs": 0}, method="POST")
    assert status == 200 and echo["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert len(echo["choices"][0]["logprobs"]["token_logprobs"]) == 2
    for body, reason in (({"max_tokens": 3}, "prompt"), ({"prompt": "x", "n": 2}, "n > 1"),
                         ({"prompt": "x", "stream": True}, "stream"), ({"prompt": [10 ** 9]}, "token ids")):
        status, out = _call(server, "/completions", body, method="POST")
        assert status == 400 and reason in out["message"], (body, out)


def test_eight_concurrent_requests_equal_their_alone_answers(server):
    words = ["The", "A cat sat", "Once upon a time there", "In the", "Hello", "We the people of",
             "It was", "Numbers: one two"]
    bodies = [{"prompts": [w], "tokens_to_generate": 12 + 3 * i, "top_k": 1, "logprobs": True}
              for i, w in enumerate(words)]
    alone = [_call(server, "/api", b)[1] for b in bodies]
    results = [None] * len(bodies)

    def client(i):
        results[i] = _call(server, "/api", bodies[i])[1]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, r in zip(alone, results):
        assert r["tokens"] == a["tokens"]
        # Another batch size changes the CPU GEMM blocking: fp32 log-probs move by ~1e-6.
        assert max(abs(x - y) for x, y in zip(r["logprobs"][0], a["logprobs"][0])) < 1e-4
    stats = json.loads(urllib.request.urlopen(server).read())
    assert stats["peak_active"] > 1  # they shared decode steps instead of queueing one after another
