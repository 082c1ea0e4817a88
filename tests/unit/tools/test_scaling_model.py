"""tools/scaling_model.py: the presets' FLOPs equal the training log's formula on the benchmark configs' own
flags, the pipeline bubble is (p-1)/(m vp), communication grows with TP and across nodes, the calibrate mode
reports each row's error (JSON and CSV), and measure-bandwidth runs on 2 gloo ranks."""
import csv
import json

import pytest

from megatron.training.arguments import parse_args
from megatron.training.flops import num_floating_point_operations
from tests.parallel.dist_utils import run_distributed
from tools import scaling_bandwidth
from tools.scaling_model import (
    Assumptions,
    Bandwidth,
    Compute,
    bubble_fraction,
    compute_from_measurement,
    load_bandwidth,
    main,
    model_flops,
    predict,
)
from tools.scaling_presets import PRESETS, Layout

# The shape flags of ../shared/megatron_reference/configs.sh (GPT13B, LLAMA8B, MOE_*) and of the published
# configurations, as a Megatron user passes them.
FLAGS = {
    "GPT13B": "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 "
              "--seq-length 2048 --vocab-size 50304",
    "LLAMA8B": "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
               "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --swiglu "
               "--vocab-size 128256",
    "LLAMA70B": "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
                "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --swiglu "
                "--vocab-size 128256",
    "GPT175B": "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --ffn-hidden-size 49152 "
               "--seq-length 2048 --vocab-size 51200",
    "MOE_MIXTRAL": "--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --group-query-attention "
                   "--num-query-groups 4 --ffn-hidden-size 5632 --seq-length 4096 --swiglu --vocab-size 32000 "
                   "--num-experts 8 --moe-router-topk 2",
    "MOE_FINE": "--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --group-query-attention "
                "--num-query-groups 4 --ffn-hidden-size 5632 --seq-length 4096 --swiglu --vocab-size 32000 "
                "--num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1408 "
                "--moe-shared-expert-intermediate-size 2816",
}


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_preset_flops_equal_the_formula_on_the_megatron_flags(name):
    args = parse_args(argv=FLAGS[name].split())
    assert model_flops(PRESETS[name], 4) == num_floating_point_operations(args, 4)


def test_gpt3_flops_in_closed_form():
    L, h, s, V = 96, 12288, 2048, 51200
    per_token = 6 * L * 12 * h * h + 6 * s * h * L + 6 * h * V  # 4h^2 attention + 8h^2 MLP; causal QK^T/AV
    assert model_flops(PRESETS["GPT175B"], 1) == s * per_token


RATE = Compute("test", "H100", 600e12)
NO_COMM = Bandwidth()


def test_bubble_is_p_minus_1_over_m_vp():
    assert bubble_fraction(4, 8) == 3 / 8 and bubble_fraction(4, 8, 2) == 3 / 16 and bubble_fraction(1, 8) == 0
    shape = PRESETS["LLAMA8B"]
    for vp in (1, 2, 4):
        lay = Layout(gpus=4, gbs=16, pp=4, vp=vp)
        pred = predict(shape, lay, RATE, NO_COMM)
        assert pred["bubble_fraction"] == bubble_fraction(4, 16, vp)
        # Without TP/CP/EP the stage time is pure compute: the bubble is that fraction of the compute.
        assert pred["ms"]["pp_bubble"] == pytest.approx(pred["ms"]["compute"] * bubble_fraction(4, 16, vp))


def test_more_tp_means_more_communication_and_fewer_tokens():
    shape = PRESETS["GPT175B"]  # 96 heads: TP up to 16
    exposed = [predict(shape, Layout(gpus=64, gbs=64, tp=tp, gpus_per_node=8), RATE, NO_COMM)["ms"]["tp_exposed"]
               for tp in (1, 2, 4, 8, 16)]
    assert exposed[0] == 0 and all(a < b for a, b in zip(exposed, exposed[1:]))
    # Within one node (where the DP sync of the unsplit model hides behind the backward), more TP is slower.
    tokens = [predict(PRESETS["LLAMA8B"], Layout(gpus=8, gbs=64, tp=tp), RATE, NO_COMM)["tokens_per_s_per_gpu"]
              for tp in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(tokens, tokens[1:]))
    # TP=16 leaves the 8-GPU node: its collectives run at the inter-node bandwidth, far slower per byte.
    assert exposed[4] / exposed[3] > 4
    # Overlap hides communication, never adds it.
    overlapped = predict(shape, Layout(gpus=64, gbs=64, tp=8, tp_comm_overlap=True), RATE, NO_COMM)
    assert overlapped["ms"]["tp_exposed"] < exposed[3]


def test_data_parallel_sync_exposed_only_without_overlap():
    shape, plain_flags = PRESETS["LLAMA8B"], dict(overlap_grad_reduce=False, overlap_param_gather=False)
    hidden = predict(shape, Layout(gpus=8, gbs=64), RATE, NO_COMM)["ms"]
    plain = predict(shape, Layout(gpus=8, gbs=64, **plain_flags), RATE, NO_COMM)["ms"]
    assert plain["dp_grad_reduce"] > 10 * hidden["dp_grad_reduce"] > 0
    assert plain["dp_param_gather"] > 10 * hidden["dp_param_gather"] > 0
    # DP=16 spans two nodes: slower than DP=8 within one.
    two_nodes = predict(shape, Layout(gpus=16, gbs=64, **plain_flags), RATE, NO_COMM)["ms"]
    assert two_nodes["dp_grad_reduce"] > 3 * plain["dp_grad_reduce"]


def test_bandwidth_interpolates_by_size_and_uses_the_inter_node_figure():
    rows = [{"bytes": 2**20, "busbw_GBps": 10.0}, {"bytes": 2**24, "busbw_GBps": 200.0}]
    bw = Bandwidth({"ops": {"all_gather": rows}})
    assert bw.busbw("all_gather", 2**20, True) == 10e9 and bw.busbw("all_gather", 2**26, True) == 200e9
    assert 10e9 < bw.busbw("all_gather", 2**22, True) < 200e9
    assert bw.busbw("all_gather", 2**19, True) == 5e9  # below the table: the smallest size's time
    a = Assumptions()
    assert bw.busbw("all_gather", 2**26, False) == a.inter_node_gbps / 8 * 1e9 * a.inter_node_efficiency


def _tiny_file(tmp_path):
    compute = {"key": "c", "device": "H100", "model": {"preset": "LLAMA8B", "layers": 4}, "mbs": 1, "gbs": 2,
               "ms_per_iteration": 500.0}
    rows = [
        {"label": "same as the compute run", "device": "H100", "compute": "c", "model": compute["model"],
         "layout": {"gpus": 1, "gbs": 2}, "measured_tokens_per_s_per_gpu": 2 * 8192 / 0.5},
        {"label": "TP=2 at half the prediction", "device": "H100", "compute": "c", "model": compute["model"],
         "layout": {"gpus": 2, "gbs": 2, "tp": 2}, "measured_tokens_per_s_per_gpu": None},
    ]
    c = compute_from_measurement(compute)
    rows[1]["measured_tokens_per_s_per_gpu"] = predict(
        PRESETS["LLAMA8B"].with_(layers=4), Layout(gpus=2, gbs=2, tp=2), c, load_bandwidth(None)
    )["tokens_per_s_per_gpu"] / 2
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"compute": [compute], "rows": rows, "published_compute": "c"}))
    return path, rows


def test_calibrate_prints_each_rows_error(tmp_path, capsys):
    path, _ = _tiny_file(tmp_path)
    assert main(["calibrate", "--rows", str(path), "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "| same as the compute run | H100 | 32,768 | 32,768 | +0.0% |" in out
    assert "| TP=2 at half the prediction |" in out and "| +100.0% |" in out
    results = json.loads((tmp_path / "out.json").read_text())
    assert results[0]["error"] == pytest.approx(0.0, abs=1e-9) and results[1]["error"] == pytest.approx(1.0)
    assert "mean |error| 50.0%, max 100.0% over 2 rows" in out


def test_calibrate_reads_csv_rows(tmp_path, capsys, monkeypatch):
    path, rows = _tiny_file(tmp_path)
    monkeypatch.setattr("tools.scaling_model.CALIBRATION", str(path))  # the CSV's compute entries
    with open(tmp_path / "rows.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "device", "compute", "model", "measured_tokens_per_s_per_gpu", "gpus", "gbs", "tp"])
        w.writerow(["csv TP=2", "H100", "c", "LLAMA8B", rows[1]["measured_tokens_per_s_per_gpu"], 2, 2, 2])
    assert main(["calibrate", "--rows", str(tmp_path / "rows.csv")]) == 0
    assert "| csv TP=2 | H100 |" in capsys.readouterr().out


def test_published_mode_prints_the_three_rows(capsys):
    assert main(["published"]) == 0
    out = capsys.readouterr().out
    for label, published in (("Llama-3.1-8B", "10,682"), ("Llama-3-70B", "1,118"), ("GPT-3 175B", "493")):
        line = next(x for x in out.splitlines() if x.startswith(f"| {label}"))
        assert f"| {published} |" in line


def test_routing_imbalance_adds_the_busiest_ranks_extra_expert_work():
    """moe_rank_load L adds (L - 1) x the routed experts' GEMM time per MoE layer and micro-batch with EP; on one
    EP rank every expert is local and imbalance costs nothing."""
    shape = PRESETS["MOE_MIXTRAL"]
    lay = dict(gpus=4, gbs=32, mbs=2, ep=4, dist_opt=False)
    balanced = predict(shape, Layout(**lay), RATE, NO_COMM)
    skewed = predict(shape, Layout(**lay, moe_rank_load=1.5), RATE, NO_COMM)
    # 8 experts of 3 x 2048 x 5632, top-2: the routed FLOPs of one MoE layer and micro-batch (fwd + bwd).
    routed = 6 * 4096 * 2 * 3 * 2048 * 5632 * 2
    per_mb = 0.5 * routed / RATE.rate / (2048 / (2048 + Assumptions().gemm_knee))
    assert skewed["ms"]["moe_imbalance"] == pytest.approx(4 * 8 * per_mb * 1e3, rel=1e-9)  # 4 mb x 8 layers
    assert skewed["iteration_ms"] - balanced["iteration_ms"] == pytest.approx(skewed["ms"]["moe_imbalance"])
    assert balanced["ms"]["moe_imbalance"] == 0.0
    one_rank = dict(lay, gpus=1, gbs=8, ep=1)
    assert predict(shape, Layout(**one_rank, moe_rank_load=1.5), RATE, NO_COMM)["ms"]["moe_imbalance"] == 0.0
    with pytest.raises(ValueError, match="below 1.0"):
        predict(shape, Layout(**lay, moe_rank_load=0.9), RATE, NO_COMM)


def test_expert_parallel_overlap_hides_the_paired_all_to_alls():
    """--overlap-moe-expert-parallel-comm: an all-to-all shorter than the other micro-batch's compute of the layer
    hides behind it, so of m micro-batches only the step's first forward and last backward exchange (1/m of the
    plain time) stays exposed; with one micro-batch per rank nothing pairs and nothing changes; a slow link
    leaves the excess over the partner's compute exposed."""
    shape, bw = PRESETS["MOE_MIXTRAL"], load_bandwidth(None)
    lay = dict(gpus=4, gbs=32, mbs=2, ep=4, dist_opt=False)
    plain = predict(shape, Layout(**lay), RATE, bw)["ms"]["ep_all_to_all"]
    hidden = predict(shape, Layout(**lay, ep_overlap=True), RATE, bw)["ms"]["ep_all_to_all"]
    assert plain > 0 and hidden == pytest.approx(plain / 4)  # 4 micro-batches per rank
    single = dict(lay, gbs=8)  # one micro-batch per rank
    assert predict(shape, Layout(**single, ep_overlap=True), RATE, bw)["ms"]["ep_all_to_all"] == pytest.approx(
        predict(shape, Layout(**single), RATE, bw)["ms"]["ep_all_to_all"])
    across_nodes = dict(lay, gpus=8, gbs=64, ep=8, gpus_per_node=2)  # the exchange leaves the node
    slow_plain = predict(shape, Layout(**across_nodes), RATE, bw)["ms"]["ep_all_to_all"]
    slow_hidden = predict(shape, Layout(**across_nodes, ep_overlap=True), RATE, bw)["ms"]["ep_all_to_all"]
    assert slow_plain / 4 < slow_hidden < slow_plain


def test_layout_errors_name_the_problem():
    with pytest.raises(ValueError, match="not a multiple of TP x PP x CP"):
        predict(PRESETS["LLAMA8B"], Layout(gpus=6, gbs=8, tp=4), RATE, NO_COMM)
    with pytest.raises(ValueError, match="do not split into PP"):
        predict(PRESETS["LLAMA8B"], Layout(gpus=6, gbs=6, pp=3), RATE, NO_COMM)


def test_pipeline_layout_moves_work_off_the_output_layers_stage():
    """With --pipeline-model-parallel-layout the pipeline runs at its slowest rank's pace: the even split
    written as a layout predicts what the even split does; giving the output layer's stage fewer layers (Llama-
    3's head costs about 2 layers) is faster; a layout that does not hold the model is refused."""
    shape, lay = PRESETS["LLAMA8B"], dict(gpus=4, gbs=32, pp=2)
    even = predict(shape, Layout(**lay), RATE, NO_COMM)
    written = predict(shape, Layout(**lay, pp_layout="Et*16|t*16L"), RATE, NO_COMM)
    assert written["iteration_ms"] == pytest.approx(even["iteration_ms"], rel=1e-12)
    balanced = predict(shape, Layout(**lay, pp_layout="Et*17|t*15L"), RATE, NO_COMM)
    assert balanced["iteration_ms"] < even["iteration_ms"]
    # the slowest rank is now the first: 17 layers against 15 + the head (~2.1 layers)
    assert balanced["ms"]["compute"] / even["ms"]["compute"] == pytest.approx(17 / (16 + 2.1), rel=0.02)
    interleaved = predict(shape, Layout(gpus=4, gbs=32, pp=2, vp=2, pp_layout="Et*9|t*8|t*8|t*7L"), RATE, NO_COMM)
    assert interleaved["ms"]["pp_bubble"] < balanced["ms"]["pp_bubble"]  # the bubble shrinks by VP
    with pytest.raises(ValueError, match="places 16 transformer layers"):
        predict(shape, Layout(**lay, pp_layout="Et*8|t*8L"), RATE, NO_COMM)
    with pytest.raises(ValueError, match="set vp"):
        predict(shape, Layout(**lay, pp_layout="Et*9|t*8|t*8|t*7L"), RATE, NO_COMM)


def test_context_parallel_pays_the_block_split_on_the_layer_time():
    """CP splits attention into CP x CP blocks: each layer's time grows by cp_overhead x (CP - 1) / CP (0.19,
    from the measured CP=2 and CP=4 rows); the output layer's does not. With the ring hidden (64k) a layer at
    CP=4 costs 1.1425 x a quarter of its CP=1 time."""
    def per_layer(cp, a=Assumptions()):
        ms = [predict(PRESETS["LLAMA8B"].with_(layers=n, seq=65536), Layout(gpus=cp, gbs=1, cp=cp, recompute=True),
                      RATE, NO_COMM, a)["ms"]["compute"] for n in (8, 16)]
        return (ms[1] - ms[0]) / 8

    assert per_layer(4) * 4 / per_layer(1) == pytest.approx(1 + 0.19 * 3 / 4, rel=1e-9)
    assert per_layer(4, Assumptions(cp_overhead=0)) * 4 == pytest.approx(per_layer(1), rel=1e-9)


def _measure(path):
    return scaling_bandwidth.run(path, [0.004, 0.03], warmup=1, iters=2)


def test_measure_bandwidth_on_two_gloo_ranks(tmp_path):
    path = str(tmp_path / "bw.json")
    results = run_distributed(_measure, 2, path, timeout=300)
    assert results[0]["ops"] == results[1]["ops"]  # the slowest rank's time, on both ranks
    written = json.loads(open(path).read())
    assert written["world_size"] == 2 and written["backend"] == "gloo"
    assert set(written["ops"]) == set(scaling_bandwidth.OPS)
    for op, rows in written["ops"].items():
        assert [r["bytes"] for r in rows] == sorted(r["bytes"] for r in rows)
        for r in rows:
            assert r["ms"] > 0
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * scaling_bandwidth.bus_factor(op, 2))
    assert load_bandwidth(path).busbw("all_reduce", 2**14, True) > 0
