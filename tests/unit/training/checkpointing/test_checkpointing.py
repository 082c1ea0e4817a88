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
from tests import ROOT


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
             ckpt_fallback_to_previous=False, verify_integrity=False,
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


def _data_files(d):
    """{name: bytes} of a torch_dist checkpoint's tensor files (`.distcp`)."""
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d)) if n.endswith(".distcp")}


def test_async_saves_through_host_buffers_equal_sync_saves_bitwise(tmp_path, capsys):
    """Two saves per run: sync, async through the run's reusable host buffers (the default), async with
    --no-async-save-pinned-buffers (fresh buffers per save). Same files; reused buffers stay allocated."""
    files = {}
    for name, kw in (("sync", {}), ("reuse", dict(async_save=True)),
                     ("fresh", dict(async_save=True, async_save_pinned_buffers=False))):
        args = make_args(str(tmp_path / name), **kw)
        set_args(args)
        model, opt, sched = build(args)
        train(args, model, opt, sched, 0, 4, save_at=(2, 4), async_save=args.async_save)
        files[name] = [_data_files(str(tmp_path / name / f"iter_000000{i}")) for i in (2, 4)]
        if name == "reuse":
            staging = async_utils.host_staging()
            assert staging.nbytes >= staging.stats["bytes"] >= 3 * sum(p.nbytes for p in model[0].parameters())
            assert staging.stats["alloc_s"] == 0.0  # the second save reused the first save's buffers
            async_utils.maybe_finalize_async_save(terminate=True)
            assert staging.nbytes == 0  # freed at the end of training
    assert files["sync"] == files["reuse"] == files["fresh"]
    assert files["sync"][0] != files["sync"][1]
    assert "host copy of" in capsys.readouterr().out


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


FAULTS = ["staging_created", "data_written", "before_publish", "published", "tracker_tmp_written"]


def _writer(save_dir, first, last, async_save, fault):
    """Forked child: save iterations first..last (tensors of checkpoint k filled with k), then exit."""
    os.environ.pop("MEGATRON_CKPT_FAULT", None)
    if fault:
        os.environ["MEGATRON_CKPT_FAULT"] = fault
    init_single_rank()
    args = make_args(save_dir, async_save=async_save)
    set_args(args)
    model, opt, sched = build(args)
    for it in range(first, last + 1):
        with torch.no_grad():
            for p in model[0].parameters():
                p.fill_(float(it))
        save_checkpoint(it, model, opt, sched, float(it))
        async_utils.maybe_finalize_async_save(blocking=False)
    async_utils.maybe_finalize_async_save(blocking=True)


def _fork(fn, *a):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            import contextlib
            import io
            with contextlib.redirect_stdout(io.StringIO()):
                fn(*a)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        os._exit(code)
    return pid


def _loaded_iteration(save_dir):
    args = make_args(None, load=save_dir)
    set_args(args)
    model, opt, sched = build(args)
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        it, _ = load_checkpoint(model, opt, sched)
    assert it == 0 or all(torch.all(p == float(it)) for p in model[0].parameters()), it
    return it


def kill_driver(base):
    """Return [(name, signal status, loaded iteration, expected minimum)] for every kill point."""
    out = []
    for async_save in (False, True):
        for fault in FAULTS:
            d = os.path.join(base, f"{fault}_{async_save}")
            assert os.waitpid(_fork(_writer, d, 1, 1, async_save, None), 0)[1] == 0
            status = os.waitpid(_fork(_writer, d, 2, 2, async_save, fault), 0)[1]
            out.append((f"{fault}/async={async_save}", status, _loaded_iteration(d), 1))
    rng = random.Random(0)
    for i in range(6):
        d = os.path.join(base, f"random{i}")
        assert os.waitpid(_fork(_writer, d, 1, 1, bool(i % 2), None), 0)[1] == 0
        pid = _fork(_writer, d, 2, 400, bool(i % 2), None)
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
        out.append((f"random{i}", status, _loaded_iteration(d), 1))
    return out


def test_kill_during_saves_leaves_previous_checkpoint(tmp_path):
    """kill -9 at each stage of sync and async saves and at random moments: the tracker always names a
    complete checkpoint whose contents are those of its iteration (16 kill points)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("MEGATRON_CKPT_FAULT", None)
    code = (f"from tests.unit.training.checkpointing.test_checkpointing import kill_driver; "
            f"print('RESULT', kill_driver({str(tmp_path)!r}))")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = eval(res.stdout.split("RESULT", 1)[1])
    assert len(results) == 16
    for name, status, it, least in results:
        if not name.startswith("random"):
            assert status == signal.SIGKILL, (name, status)  # killed by the fault point itself
        assert it >= least, (name, it)


def test_bf16_main_params_follow_loaded_weights_without_optimizer_state(tmp_path):
    """--no-load-optim / --finetune: the fp32 main params must be refreshed from the loaded bf16 weights,
    or the first step would write the random init back into the model."""
    d = str(tmp_path / "ck")
    for step, seed in ((0, 1234), (1, 99)):
        args = make_args(d, load=d if step else None, no_load_optim=bool(step))
        set_args(args)
        torch.manual_seed(seed)
        model = ToyModel().bfloat16()
        opt = get_megatron_optimizer(OptimizerConfig(lr=0.05, bf16=True), [model])
        if step == 0:
            save_checkpoint(1, [model], opt, None, 1.0)
            saved = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            assert load_checkpoint([model], opt, None)[0] == 1
    for p in model.parameters():
        assert torch.equal(p.main_param, p.float())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_load_args_from_checkpoint(tmp_path):
    from megatron.training.arguments import ArgumentError
    from megatron.training.checkpointing.args import load_args_from_checkpoint
    d = str(tmp_path / "ck")
    args = make_args(d, num_layers=3, hidden_size=8, swiglu=True, tokenizer_type="NullTokenizer")
    set_args(args)
    model, opt, sched = build(args)
    train(args, model, opt, sched, 0, 1, save_at=(1,))
    fresh = argparse.Namespace(load=d, ckpt_step=None, num_layers=None, hidden_size=16, swiglu=False,
                               tokenizer_type=None)
    load_args_from_checkpoint(fresh)
    # unset flags and forced (boolean / choice) flags come from the checkpoint; explicit sizes are kept
    assert (fresh.num_layers, fresh.hidden_size, fresh.swiglu, fresh.tokenizer_type) == (3, 16, True,
                                                                                          "NullTokenizer")
    with pytest.raises(ArgumentError, match="--use-checkpoint-args: no checkpoint tracker"):
        load_args_from_checkpoint(argparse.Namespace(load=str(tmp_path / "none"), ckpt_step=None))
    with pytest.raises(ArgumentError, match="needs --load"):
        load_args_from_checkpoint(argparse.Namespace(load=None, ckpt_step=None))


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_unreadable_latest_named_and_fallback_to_previous(tmp_path, fmt, capsys):
    """A truncated file of the latest checkpoint is named at load; --ckpt-fallback-to-previous loads the newest
    older complete checkpoint instead (its weights, its iteration)."""
    from megatron.core.dist_checkpointing import CheckpointingException
    d = str(tmp_path / "ck")
    set_args(make_args(d, ckpt_format=fmt))
    model, opt, sched = build(make_args(d))
    for it in (2, 4):
        with torch.no_grad():
            for p in model[0].parameters():
                p.fill_(float(it))
        save_checkpoint(it, model, opt, sched, float(it))
    name = "mp_rank_00/model_optim_rng.pt" if fmt == "torch" else "__0_0.distcp"
    shard = os.path.join(d, "iter_0000004", name)
    os.truncate(shard, os.path.getsize(shard) // 2)
    set_args(make_args(d, load=d, ckpt_format=fmt))
    with pytest.raises(CheckpointingException, match=f"{shard}.*; pass --ckpt-fallback-to-previous to load "
                                                     f"iteration 2 instead"):
        load_checkpoint(*build(make_args(d)))
    set_args(make_args(d, load=d, ckpt_format=fmt, ckpt_fallback_to_previous=True))
    model, opt, sched = build(make_args(d))
    assert load_checkpoint(model, opt, sched) == (2, 2.0)
    assert all(torch.all(p == 2.0) for p in model[0].parameters())
    assert "--ckpt-fallback-to-previous: loading iteration 2 instead" in capsys.readouterr().out
    os.truncate(os.path.join(d, "iter_0000002", name), 10)  # nothing readable left: one line says so
    with pytest.raises(CheckpointingException, match="no checkpoint under .* can be loaded; the oldest tried, "
                                                     "iteration 2"):
        load_checkpoint(*build(make_args(d)))


def test_corrupt_dcp_item_names_the_file(tmp_path):
    """Garbled bytes at the start of a stored tensor: the load error names the file and the byte range."""
    from megatron.core.dist_checkpointing import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.torch import read_metadata
    d = str(tmp_path / "ck")
    set_args(make_args(d))
    model, opt, sched = build(make_args(d))
    save_checkpoint(1, model, opt, sched, 1.0)
    ckpt = os.path.join(d, "iter_0000001")
    info = next(v for k, v in read_metadata(ckpt).storage_data.items() if k.fqn == "fc1.weight")
    with open(os.path.join(ckpt, info.relative_path), "r+b") as f:
        f.seek(info.offset)
        f.write(b"\0" * 64)  # the zip header of the stored tensor
    set_args(make_args(d, load=d))
    with pytest.raises(CheckpointingException, match=f"corrupted checkpoint file {ckpt}/{info.relative_path} "
                                                     f"\\(bytes {info.offset}-{info.offset + info.length}\\)"):
        load_checkpoint(*build(make_args(d)))


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys, async_save):
    """MEGATRON_CKPT_FAULT=writing:enospc@2: the save of iteration 2 fails after writing its shards. Sync: one
    line names the error and the checkpoint that stays the latest. Async: a warning, training goes on. Either
    way the staging directory is removed and the tracker still names iteration 1."""
    from megatron.core.dist_checkpointing import CheckpointingException
    d = str(tmp_path / "ck")
    set_args(make_args(d, async_save=async_save))
    model, opt, sched = build(make_args(d))
    save_checkpoint(1, model, opt, sched, 1.0)
    async_utils.maybe_finalize_async_save(blocking=True)
    monkeypatch.setenv("MEGATRON_CKPT_FAULT", "writing:enospc@2")
    if async_save:
        save_checkpoint(2, model, opt, sched, 2.0)
        async_utils.maybe_finalize_async_save(blocking=True)
        assert "WARNING: async checkpoint save" in capsys.readouterr().out
    else:
        with pytest.raises(CheckpointingException, match=f"saving the checkpoint of iteration 2 to {d} failed: "
                                                         r"\[Errno 28\] No space left on device .*; iteration 1 "
                                                         r"stays the latest checkpoint"):
            save_checkpoint(2, model, opt, sched, 2.0)
    assert sorted(os.listdir(d)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert open(os.path.join(d, "latest_checkpointed_iteration.txt")).read() == "1"


def _reserve(tmp_path, monkeypatch, available):
    """reserve_async_save_buffers as on a CUDA host with ``available`` bytes of host memory: (bytes it returned,
    the sizes HostStaging.reserve was asked for)."""
    from megatron.core.dist_checkpointing.strategies.staging import HostStaging
    from megatron.training.checkpointing import reserve_async_save_buffers
    from megatron.training.checkpointing import save as save_module
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(save_module, "_host_memory_available", lambda: available)
    monkeypatch.setattr(HostStaging, "reserve", lambda self, nbytes: asked.append(nbytes))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = make_args(str(tmp_path / "ck"), async_save=True)
    set_args(args)
    model, opt, sched = build(args)
    train(args, model, opt, sched, 0, 1)
    try:
        return reserve_async_save_buffers(model, opt, sched, 1), asked
    finally:
        async_utils.maybe_finalize_async_save(terminate=True)


def test_async_save_buffers_are_reserved_at_the_size_of_the_save(tmp_path, monkeypatch):
    """Sized as the save stages: the toy model's weights and Adam state (fp32 main params are the weights)."""
    nbytes, asked = _reserve(tmp_path, monkeypatch, available=1 << 40)
    state = sum(p.numel() * 4 for p in build(make_args("x"))[0][0].parameters()) * 3  # weights, exp_avg, exp_avg_sq
    assert asked == [nbytes] and state < nbytes <= state + (1 << 20) + 64 * 512


def test_async_save_buffers_not_reserved_beyond_the_hosts_memory(tmp_path, monkeypatch, capsys):
    nbytes, asked = _reserve(tmp_path, monkeypatch, available=4 << 20)  # 8 ranks x ~1 MiB > 80% of 4 MiB
    assert nbytes == 0 and asked == []
    out = capsys.readouterr().out
    assert "WARNING: --async-save keeps" in out and "--no-async-save-pinned-buffers" in out and "8 ranks" in out
