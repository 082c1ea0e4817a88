"""save_checkpoint / load_checkpoint: exact resume, kill -9 during saves, async, bad inputs.

A toy model with a real Megatron optimizer and LR scheduler; the data comes from the global torch RNG,
so the resumed losses match only if parameters, optimizer, scheduler and RNG were all restored.
"""
import argparse
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training import async_utils
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.global_vars import set_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ToyModel(torch.nn.Module):
    def __init__(self, hidden=8, width=64):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, width * hidden // 8)
        self.fc2 = torch.nn.Linear(width * hidden // 8, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

    def sharded_state_dict(self, prefix=""):
        return {k: ShardedTensor.from_rank_offsets(prefix + k, v) for k, v in self.state_dict().items()}


def init_single_rank():
    """The optimizer's grad-norm all-reduce needs a (one-rank) process group."""
    if not torch.distributed.is_initialized():
        from tests.parallel.dist_utils import free_port
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                             rank=0, world_size=1)


@pytest.fixture(autouse=True)
def _single_rank():
    init_single_rank()


def make_args(save, load=None, **kw):
    a = dict(save=save, load=load, save_interval=1, ckpt_format="torch_dist", auto_detect_ckpt_format=False,
             no_save_optim=False, no_save_rng=False, no_load_optim=False, no_load_rng=False, finetune=False,
             pretrained_checkpoint=None, ckpt_step=None, exit_on_missing_checkpoint=False, async_save=False,
             save_retain_interval=None, num_layers=2, hidden_size=8, num_attention_heads=2,
             consumed_train_samples=0, consumed_valid_samples=0)
    a.update(kw)
    return argparse.Namespace(**a)


def build(args, width=64):
    torch.manual_seed(1234)
    model = ToyModel(width=width)
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.05, min_lr=0.0, weight_decay=0.01, clip_grad=1.0), [model])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=0.05, min_lr=0.001, lr_warmup_steps=2,
                                    lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=20, wd_incr_style="constant")
    return [model], opt, sched


def train(args, model, opt, sched, start, stop, save_at=(), async_save=False):
    losses = []
    for it in range(start + 1, stop + 1):
        x = torch.randn(4, 4)  # data from the global RNG: resumes only if RNG is restored
        opt.zero_grad()
        loss = (model[0](x) ** 2).mean()
        loss.backward()
        opt.step()
        sched.step(increment=4)
        args.consumed_train_samples += 4
        losses.append(f"{loss.item():.10e}")
        if it in save_at:
            save_checkpoint(it, model, opt, sched, float(it))
        if async_save:
            async_utils.maybe_finalize_async_save(blocking=False)
    async_utils.maybe_finalize_async_save(blocking=True)
    return losses


def run_and_resume(tmp_path, async_save=False, ckpt_format="torch_dist"):
    d = str(tmp_path / "ck")
    args = make_args(d, async_save=async_save, ckpt_format=ckpt_format)
    set_args(args)
    straight = train(args, *build(args), 0, 8, save_at=(4,), async_save=async_save)
    args2 = make_args(d, load=d, async_save=async_save, ckpt_format=ckpt_format)
    set_args(args2)
    m, o, s = build(args2)
    torch.manual_seed(999)  # would change the data if RNG were not restored
    it, flops = load_checkpoint(m, o, s)
    assert (it, flops, args2.consumed_train_samples) == (4, 4.0, 16)
    return straight, straight[:4] + train(args2, m, o, s, it, 8)


@pytest.mark.parametrize("fmt,async_save", [("torch_dist", False), ("torch_dist", True), ("torch", False)])
def test_exact_resume(tmp_path, fmt, async_save):
    straight, resumed = run_and_resume(tmp_path, async_save, fmt)
    assert straight == resumed
    assert open(tmp_path / "ck" / "latest_checkpointed_iteration.txt").read() == "4"
    sub = "mp_rank_00/model_optim_rng.pt" if fmt == "torch" else "metadata.json"
    assert (tmp_path / "ck" / "iter_0000004" / sub).exists()
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path / "ck"))


def test_async_and_sync_saves_equal(tmp_path):
    from megatron.core import dist_checkpointing as dc
    outs = []
    for name, a in (("s", False), ("a", True)):
        args = make_args(str(tmp_path / name), async_save=a)
        set_args(args)
        model, opt, sched = build(args)
        train(args, model, opt, sched, 0, 3, save_at=(3,), async_save=a)
        d = str(tmp_path / name / "iter_0000003")
        sd = {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in model[0].state_dict().items()}
        outs.append((dc.load(sd, d), dc.load_tensors_metadata(d)))
    (ls, ms), (la, ma) = outs
    assert ms == ma and all(torch.equal(ls[k], la[k]) for k in ("fc1.weight", "fc2.bias"))


def test_missing_and_mismatched(tmp_path, capsys):
    d = str(tmp_path / "ck")
    args = make_args(d, load=d)
    set_args(args)
    model, opt, sched = build(args)
    assert load_checkpoint(model, opt, sched) == (0, 0)
    assert "will start from random" in capsys.readouterr().out
    args.exit_on_missing_checkpoint = True
    with pytest.raises(SystemExit):
        load_checkpoint(model, opt, sched)
    args.exit_on_missing_checkpoint = False
    train(args, model, opt, sched, 0, 1, save_at=(1,))
    set_args(make_args(d, load=d, hidden_size=16))
    with pytest.raises(ValueError, match="--hidden-size: checkpoint 8, this run 16"):
        load_checkpoint(*build(args))
    set_args(make_args(d, load=d, ckpt_format="torch"))
    with pytest.raises(ValueError, match="pass --ckpt-format torch_dist or --auto-detect-ckpt-format"):
        load_checkpoint(*build(args))
    set_args(make_args(d, load=d, ckpt_step=7))
    with pytest.raises(ValueError, match="--ckpt-step 7"):
        load_checkpoint(*build(args))
    with open(os.path.join(d, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("garbage")
    set_args(make_args(d, load=d))
    with pytest.raises(ValueError, match="tracker file .* holds 'garbage'"):
        load_checkpoint(*build(args))


def test_retain_interval(tmp_path):
    d = str(tmp_path / "ck")
    args = make_args(d, save_retain_interval=2)
    set_args(args)
    train(args, *build(args), 0, 5, save_at=(1, 2, 3, 4, 5))
    assert sorted(n for n in os.listdir(d) if n.startswith("iter_")) == ["iter_0000002", "iter_0000004",
                                                                          "iter_0000005"]


# ---- kill -9 during saves --------------------------------------------------------------------------
def child_main(save_dir, n_saves, async_save, width):
    """Save iterations 1..n_saves; tensors in checkpoint k are filled with k."""
    init_single_rank()
    args = make_args(save_dir, async_save=async_save)
    set_args(args)
    model, opt, sched = build(args, width=width)
    for it in range(1, n_saves + 1):
        with torch.no_grad():
            for p in model[0].parameters():
                p.fill_(float(it))
        save_checkpoint(it, model, opt, sched, float(it))
        async_utils.maybe_finalize_async_save(blocking=False)
        print(f"saved {it}", flush=True)
    async_utils.maybe_finalize_async_save(blocking=True)


def _spawn(save_dir, n_saves, async_save, fault=None, width=64):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("MEGATRON_CKPT_FAULT", None)
    if fault:
        env["MEGATRON_CKPT_FAULT"] = fault
    code = (f"from tests.unit.test_dist_checkpointing_training import child_main; "
            f"child_main({save_dir!r}, {n_saves}, {async_save}, {width})")
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _check_loadable(save_dir, expect=None, width=64):
    args = make_args(None, load=save_dir)
    set_args(args)
    model, opt, sched = build(args, width=width)
    it, _ = load_checkpoint(model, opt, sched)
    if expect is not None:
        assert it == expect
    if it:
        assert all(torch.all(p == float(it)) for p in model[0].parameters())
    return it


FAULTS = ["staging_created", "data_written", "before_publish", "published", "tracker_tmp_written"]


@pytest.mark.parametrize("async_save", [False, True])
def test_kill_at_each_save_stage(tmp_path, async_save):
    """Save 1 completes in a first process; a second process dies at a fixed stage of its save of 2."""
    for fault in FAULTS:
        d = str(tmp_path / f"{fault}")
        p = _spawn(d, 1, async_save)
        assert p.wait(60) == 0, p.stdout.read()
        p = _spawn(d + "_x", 0, async_save)  # warm nothing: placeholder kept short
        p.wait(60)
        # Second process: re-saves 1 (overwrite) then dies during 2.
        code_fault = _spawn(d, 2, async_save, fault=fault)
        rc = code_fault.wait(60)
        out = code_fault.stdout.read()
        if fault in ("published", "tracker_tmp_written", "before_publish", "data_written", "staging_created"):
            assert rc == -signal.SIGKILL, out
        # The process died during save 1 (re-save) or 2; either way the tracker names a complete checkpoint.
        it = _check_loadable(d)
        assert it == 1, (fault, it, out)


def test_kill_at_random_times(tmp_path):
    """SIGKILL at random moments of a stream of saves (sync and async); the latest tracked save loads."""
    rng = random.Random(0)
    for i in range(6):
        async_save = bool(i % 2)
        d = str(tmp_path / f"r{i}")
        p = _spawn(d, 1000, async_save, width=512)
        while True:  # wait until the process is saving
            line = p.stdout.readline()
            if line.startswith("saved") or not line:
                break
        time.sleep(rng.uniform(0.0, 0.4))
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        it = _check_loadable(d, width=512)
        assert it >= 1
