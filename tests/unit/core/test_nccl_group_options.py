"""--nccl-communicator-config-path / --high-priority-stream-groups: the YAML and names checked in one line,
and each NCCL group built with the options of its Megatron name (the NCCL objects themselves: tests/gpu)."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.nccl_group_options import GROUP_NAMES, megatron_group_name, nccl_group_configs


def test_yaml_and_high_priority_groups_merge(tmp_path):
    cfg = tmp_path / "nccl.yaml"
    cfg.write_text("tp:\n  max_ctas: 16\n  min_ctas: 4\ndp:\n  cga_cluster_size: 2\n")
    out = nccl_group_configs(str(cfg), ["tp", "ep"])
    assert out == {"tp": {"max_ctas": 16, "min_ctas": 4, "is_high_priority_stream": True},
                   "dp": {"cga_cluster_size": 2}, "ep": {"is_high_priority_stream": True}}
    assert nccl_group_configs(None, None) == {}


@pytest.mark.parametrize("text, groups, match", [
    (None, ["tensor"], "--high-priority-stream-groups: unknown process group 'tensor'"),
    ("tq: {max_ctas: 1}\n", [], "unknown process group 'tq'"),
    ("tp: {max_cta: 1}\n", [], "group 'tp' has unknown option.*max_cta"),
    ("tp: {net_name: eth}\n", [], "net_name 'eth' must be IB or socket"),
    ("- tp\n", [], "expected a mapping of group name"),
])
def test_bad_input_is_one_line(tmp_path, text, groups, match):
    path = None
    if text is not None:
        path = tmp_path / "nccl.yaml"
        path.write_text(text)
    with pytest.raises(ValueError, match=match):
        nccl_group_configs(str(path) if path else None, groups)


def test_missing_file_and_gloo_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read it"):
        nccl_group_configs(str(tmp_path / "absent.yaml"), [])
    with pytest.raises(ValueError, match="this run's backend is gloo"):
        nccl_group_configs(None, ["tp"], nccl=False)
    assert nccl_group_configs(None, [], nccl=False) == {}


def test_each_group_gets_the_options_of_its_megatron_name(monkeypatch):
    """initialize_model_parallel passes every NCCL group the options its Megatron name has in the config."""
    ours = not torch.distributed.is_initialized()
    if ours:
        torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    made = []
    monkeypatch.setattr(ps.torch.distributed, "get_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(ps, "get_nccl_options", lambda name, cfgs: (name, cfgs.get(name)))
    real_new_group = torch.distributed.new_group

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, **kw):
        made.append(pg_options)
        return real_new_group(ranks, timeout=timeout, backend="gloo")
    monkeypatch.setattr(ps.torch.distributed, "new_group", new_group)
    try:
        ps.initialize_model_parallel(high_priority_stream_groups=["tp", "ep_dp"])
    finally:
        ps.destroy_model_parallel()
        if ours:
            torch.distributed.destroy_process_group()
    by_name = dict(o for o in made if o is not None)
    assert by_name["tp"] == {"is_high_priority_stream": True}
    assert by_name["ep_dp"] == {"is_high_priority_stream": True}  # our "edp" group, under Megatron's name
    assert by_name["dp"] is None and by_name["ep_tp"] is None
    assert set(by_name) <= set(GROUP_NAMES) and megatron_group_name("etp") == "ep_tp"
