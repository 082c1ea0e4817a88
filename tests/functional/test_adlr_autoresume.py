"""--adlr-autoresume through pretrain_gpt.py, with a stand-in for the cluster's autoresume service
(``userlib/auto_resume.py`` on $SUBMIT_SCRIPTS, as the cluster provides it) that asks to stop at its
second poll: the run saves that iteration, requests resumption and exits 0."""
import os
import re

from tests.functional.cli_runner import CliRunner

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


def _run(cli, submit_scripts, *extra):
    """One pretrain_gpt.py process, forked from the CliRunner (its imports paid once for both runs)."""
    (res,) = cli.run(["pretrain_gpt.py"] + CMD + list(extra), timeout=300, env={"SUBMIT_SCRIPTS": submit_scripts})
    return res


def test_autoresume_saves_requests_resume_and_exits(tmp_path):
    os.makedirs(tmp_path / "scripts" / "userlib")
    (tmp_path / "scripts" / "userlib" / "__init__.py").write_text("")
    (tmp_path / "scripts" / "userlib" / "auto_resume.py").write_text(SERVICE)
    save = str(tmp_path / "ckpt")
    with CliRunner() as cli:
        p = _run(cli, str(tmp_path / "scripts"), "--save", save, "--save-interval", "100")
        os.makedirs(tmp_path / "empty")
        missing = _run(cli, str(tmp_path / "empty"))
    assert p.rc == 0, p.out[-3000:] + p.err[-3000:]
    # Polled at iterations 2 and 4 (every rank once, rank 0 requests resumption), then stopped.
    assert (tmp_path / "scripts" / "calls.txt").read_text().split() == ["init", "poll", "poll", "request_resume"]
    iterations = [int(i) for i in re.findall(r"iteration +(\d+)/ +8 \|", p.out)]
    assert iterations == [1, 2, 3, 4]
    assert ">>> autoresume termination request found!" in p.out
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "4"

    # Without the service on the path: one line naming the flag, exit code 2 (a bad input).
    assert missing.rc == 2, missing.out[-2000:] + missing.err[-2000:]
    assert "--adlr-autoresume: cannot import userlib.auto_resume.AutoResume from SUBMIT_SCRIPTS=" in missing.err
