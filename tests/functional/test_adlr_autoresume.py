"""--adlr-autoresume through pretrain_gpt.py, with a stand-in for the cluster's autoresume service
(``userlib/auto_resume.py`` on $SUBMIT_SCRIPTS, as the cluster provides it) that asks to stop at its
second poll: the run saves that iteration, requests resumption and exits 0."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CMD = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
       "--micro-batch-size 2 --global-batch-size 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
       "--vocab-size 64 --log-interval 1 --eval-interval 100 --eval-iters 0 --num-workers 0 "
       "--train-iters 8 --adlr-autoresume --adlr-autoresume-interval 2").split()

SERVICE = '''
import os
LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "calls.txt")


def _log(what):
    with open(LOG, "a") as f:
        f.write(what + "\\n")


class AutoResume:
    polls = 0

    @staticmethod
    def init():
        _log("init")

    @staticmethod
    def termination_requested():
        AutoResume.polls += 1
        _log("poll")
        return AutoResume.polls == 2

    @staticmethod
    def request_resume():
        _log("request_resume")
'''


def _run(submit_scripts, *extra):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "SUBMIT_SCRIPTS": submit_scripts}
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + CMD + list(extra),
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)


def test_autoresume_saves_requests_resume_and_exits(tmp_path):
    os.makedirs(tmp_path / "scripts" / "userlib")
    (tmp_path / "scripts" / "userlib" / "__init__.py").write_text("")
    (tmp_path / "scripts" / "userlib" / "auto_resume.py").write_text(SERVICE)
    save = str(tmp_path / "ckpt")
    p = _run(str(tmp_path / "scripts"), "--save", save, "--save-interval", "100")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # Polled at iterations 2 and 4 (every rank once, rank 0 requests resumption), then stopped.
    assert (tmp_path / "scripts" / "calls.txt").read_text().split() == ["init", "poll", "poll", "request_resume"]
    iterations = [int(i) for i in re.findall(r"iteration +(\d+)/ +8 \|", p.stdout)]
    assert iterations == [1, 2, 3, 4]
    assert ">>> autoresume termination request found!" in p.stdout
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "4"

    # Without the service on the path: one line naming the flag, exit code 2 (a bad input).
    os.makedirs(tmp_path / "empty")
    p = _run(str(tmp_path / "empty"))
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "--adlr-autoresume: cannot import userlib.auto_resume.AutoResume from SUBMIT_SCRIPTS=" in p.stderr
