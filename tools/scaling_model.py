"""Predict tokens/s/GPU, TFLOP/s/GPU and MFU of a transformer layout on N GPUs from measured pieces.

    python tools/scaling_model.py predict --model LLAMA8B --gpus 8 --cp 2 --gbs 128 [--bandwidth bw.json]
    torchrun --nproc-per-node 2 tools/scaling_model.py measure-bandwidth --out bw.json
    python tools/scaling_model.py calibrate [--rows docs/results/scaling_calibration.json]
    python tools/scaling_model.py published

Inputs: (a) compute, one measured single-GPU run per (device, model shape): its iteration time gives the rate
R at which that GPU does the model's FLOPs (Megatron's formula, megatron/training/flops.py) once the
optimizer's estimated time is taken out; (b) communication volumes computed from the layout; (c) bus
bandwidths: intra-node from a measure-bandwidth JSON (or NVLink defaults), inter-node 400 Gb/s per GPU
(DGX H100) x 0.9; (d) the overlap rules below. The same parameters serve every row: nothing is fitted per row.

Assumptions (each also in docs/performance.md, "Scaling model"):
- Compute: a layer's time is its FLOPs / (TP x CP) at rate R, slowed for narrow GEMMs: a GEMM whose per-GPU
  width is d = hidden / TP runs at d / (d + 128) of the wide-GEMM rate (R is corrected to d -> inf with the
  calibration run's own width). Full recompute adds one forward (4/3 of the FLOPs). Norms, element-wise
  work, logits and host overheads are in R as measured. The last pipeline stage also runs the logits.
- Optimizer: fused AdamW moves 30 bytes per parameter it owns (fp32 master, grad, two moments, bf16 copy)
  at 80% of HBM bandwidth (H100 3.35 TB/s, H200 4.8 TB/s); the distributed optimizer shards it over DP x CP.
- TP with sequence parallelism: per layer and micro-batch 2 all-gathers + 2 reduce-scatters forward and
  4 + 2 backward (the 2 extra: re-gathering the input for the weight gradient) of the [s/CP, b, h] bf16
  activation; without SP 2 + 2 all-reduces; full recompute repeats the forward's. Exposed, except the 2
  wgrad re-gathers (hidden behind the dgrad GEMM, as Megatron launches them) and, with --tp-comm-overlap,
  a fraction 0.5 of the rest.
- CP (p2p ring): per layer CP-1 steps, each sending K and V of a chunk forward and K, V, dK, dV backward;
  each step hides behind the attention block computed meanwhile; only the excess is exposed. Splitting the
  attention into CP x CP blocks (smaller kernels, the log-sum-exp merges, the ring's launches) costs layer
  time: x (1 + 0.19 (CP - 1) / CP), the one constant measured for CP (ours on H200s, LLAMA8B 8 layers at
  64k: CP=2 kept 90.4% and CP=4 85.8% of CP=1's rate, both 0.19).
- PP layouts: with a --pipeline-model-parallel-layout the rank with the most work (its layers over its
  virtual stages, plus the output layer where it runs it) is the slowest stage.
- DP: gradients reduced in fp32 (4 bytes/param; Megatron's default for bf16), reduce-scatter with the
  distributed optimizer (then a bf16 param all-gather), all-reduce without; over DP x CP ranks (experts over
  DP x CP / EP). With --overlap-grad-reduce the reduce hides behind the last micro-batch's backward and with
  --overlap-param-gather the gather behind the first micro-batch's forward, except one bucket each
  (max(40M, 1M x DP) params, Megatron's bucket size); without them both are exposed.
- PP: 1F1B; the iteration is (m + (p-1)/vp) micro-batch times of the slowest stage (the last,
  unless a layout says otherwise), so the bubble
  fraction is (p-1)/(m vp). Each micro-batch sends its [s/CP/TP, b, h] activation forward and its gradient
  back; exposed with VP = 1, hidden behind compute with VP > 1 (Megatron's overlapped p2p of interleaving).
- EP: per MoE layer and micro-batch 2 all-to-alls forward (dispatch, combine) and 2 backward of the top-k
  copies of the rank's tokens, exposed (no shared-expert overlap assumed); with --overlap-moe-expert-parallel-comm
  (ep_overlap) a micro-batch's forward pair hides behind the other micro-batch's backward of the layer (2/3 of
  its compute) and its backward pair behind the other's forward (1/3), except the step's first forward and
  last backward (1 in m). Uneven routing (the layout's
  moe_rank_load, the log's `moe max rank load`) makes the busiest rank's expert GEMMs last that factor
  longer, and every rank waits for them: (load - 1) x the routed experts' compute is added per MoE layer.
- Links: a group of ranks whose span (stride x size, Megatron's rank order tp-cp-ep-dp-pp) fits in one
  node uses the intra-node bus bandwidth, interpolated by message size (log-linear, flat beyond the table,
  a constant time below it); a group spanning nodes runs at the inter-node bandwidth (its slowest link).
  NVSwitch gives each GPU its full NVLink bandwidth whatever the group, so 2-GPU measurements serve 8.
- Not modelled: tied-embedding all-reduce across stages, data loading, stragglers, memory limits.
"""
import argparse
import csv
import json
import math
import os
import sys
from argparse import Namespace
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.training.flops import num_floating_point_operations  # noqa: E402
from tools.scaling_presets import (  # noqa: E402
    DEFAULT_INTRA_BUSBW_GBPS,
    PRESETS,
    PUBLISHED,
    Layout,
    ModelShape,
    layout_from_dict,
    shape_from,
)

CALIBRATION = os.path.join(ROOT, "docs", "results", "scaling_calibration.json")
BANDWIDTH = os.path.join(ROOT, "docs", "results", "bandwidth_h200x2.json")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}
HBM_TBPS = {"H100": 3.35, "H200": 4.8}


@dataclass(frozen=True)
class Assumptions:
    """The model's global constants (the module docstring says what each stands for)."""
    gemm_knee: float = 128.0
    optimizer_bytes_per_param: float = 30.0
    hbm_efficiency: float = 0.8
    grad_bytes: float = 4.0
    param_gather_bytes: float = 2.0
    act_bytes: float = 2.0
    tp_overlap_hidden: float = 0.5
    bucket_params: float = 40e6
    inter_node_gbps: float = 400.0
    inter_node_efficiency: float = 0.9
    cp_overhead: float = 0.19


class Bandwidth:
    """Bus bandwidth (bytes/s) per op and message size: the measured intra-node table, the stated inter-node
    figure."""

    def __init__(self, measured: Optional[Dict] = None, a: Assumptions = Assumptions()):
        self.a = a
        self.source = measured.get("source", "measured") if measured else "NVLink defaults"
        self.table: Dict[str, List[Tuple[float, float]]] = {}
        if measured:
            for op, rows in measured["ops"].items():
                self.table[op] = sorted((r["bytes"], r["busbw_GBps"] * 1e9) for r in rows)
        for op, gbps in DEFAULT_INTRA_BUSBW_GBPS.items():
            # 64 MiB at the default rate; below it a constant time (latency-bound small messages).
            self.table.setdefault(op, [(64 * 2**20, gbps * 1e9)])

    def busbw(self, op: str, nbytes: float, intra: bool) -> float:
        if not intra:
            return self.a.inter_node_gbps / 8 * 1e9 * self.a.inter_node_efficiency
        rows = self.table[op]
        if nbytes <= rows[0][0]:
            return rows[0][1] * nbytes / rows[0][0]  # the smallest size's time: latency-bound
        for (s0, b0), (s1, b1) in zip(rows, rows[1:]):
            if nbytes <= s1:
                w = math.log(nbytes / s0) / math.log(s1 / s0)
                return b0 + w * (b1 - b0)
        return rows[-1][1]

    def seconds(self, op: str, nbytes: float, n: int, intra: bool) -> float:
        """Time of one op on a ``nbytes`` full tensor over ``n`` ranks (busbw convention of scaling_bandwidth)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        factor = {"all_reduce": 2.0 * (n - 1) / n, "p2p": 1.0}.get(op, (n - 1) / n)
        return nbytes * factor / self.busbw(op, nbytes, intra)


def flops_args(shape: ModelShape, seq: Optional[int] = None) -> Namespace:
    """The namespace megatron/training/flops.py reads, for ``shape``."""
    return Namespace(
        hidden_size=shape.hidden, seq_length=seq or shape.seq, num_layers=shape.layers,
        num_attention_heads=shape.heads, kv_channels=shape.kv_channels, group_query_attention=True,
        num_query_groups=shape.kv_heads, ffn_hidden_size=shape.ffn, swiglu=shape.swiglu,
        padded_vocab_size=shape.vocab, vocab_size=shape.vocab,
        num_experts=shape.experts or None, moe_layer_freq=1, moe_router_topk=shape.topk,
        moe_ffn_hidden_size=shape.moe_ffn, moe_shared_expert_intermediate_size=shape.shared_ffn or None)


def model_flops(shape: ModelShape, samples: int) -> float:
    """Megatron's training FLOPs for ``samples`` sequences (forward + backward)."""
    return float(num_floating_point_operations(flops_args(shape), samples))


def flops_split(shape: ModelShape, samples: int) -> Tuple[float, float]:
    """(FLOPs of one transformer layer, FLOPs of the logits) for ``samples`` sequences."""
    total = model_flops(shape, samples)
    head = model_flops(shape.with_(layers=0), samples)
    return (total - head) / shape.layers, head


def param_counts(shape: ModelShape) -> Tuple[float, float, float]:
    """(dense params per layer, expert params per layer, embedding + output params)."""
    h, d = shape.hidden, shape.head_dim
    attention = h * d * (shape.heads + 2 * shape.kv_heads) + shape.heads * d * h + 2 * h
    mats = 3 if shape.swiglu else 2
    if shape.experts:
        experts = shape.experts * mats * h * (shape.moe_ffn or shape.ffn)
        dense = attention + mats * h * shape.shared_ffn + h * shape.experts
    else:
        experts, dense = 0.0, attention + mats * h * shape.ffn
    return float(dense), float(experts), float(shape.vocab * h * (1 if shape.tied else 2))


def gemm_efficiency(width: float, a: Assumptions) -> float:
    return width / (width + a.gemm_knee)


def device_kind(name: str) -> str:
    for kind in ("H200", "H100"):
        if kind in name:
            return kind
    raise ValueError(f"device {name!r}: the model knows H100 and H200 (peak, HBM bandwidth)")


@dataclass(frozen=True)
class Compute:
    """The wide-GEMM FLOP rate of one device on one model, from a measured single-GPU run."""
    key: str
    device: str
    rate: float  # FLOP/s for GEMMs of unbounded width (see gemm_efficiency)
    source: str = ""


def optimizer_seconds(params: float, device: str, a: Assumptions) -> float:
    return params * a.optimizer_bytes_per_param / (HBM_TBPS[device_kind(device)] * 1e12 * a.hbm_efficiency)


def compute_from_measurement(entry: Dict, a: Assumptions = Assumptions()) -> Compute:
    """A calibration entry {key, device, model, mbs, gbs, and ms_per_iteration | tflops_per_gpu |
    ms_per_layer, recompute?} of one GPU -> its Compute."""
    shape = shape_from(entry["model"])
    width_eff = gemm_efficiency(shape.hidden, a)
    factor = 4 / 3 if entry.get("recompute") else 1.0
    if "ms_per_layer" in entry:  # one layer's forward + backward of one micro-batch
        layer, _ = flops_split(shape, entry.get("mbs", 1))
        rate = layer * factor / (entry["ms_per_layer"] * 1e-3)
    else:
        flops = model_flops(shape, entry["gbs"])
        seconds = entry["ms_per_iteration"] * 1e-3 if "ms_per_iteration" in entry \
            else flops / (entry["tflops_per_gpu"] * 1e12)
        dense, experts, embed = param_counts(shape)
        seconds -= optimizer_seconds(shape.layers * (dense + experts) + embed, entry["device"], a)
        rate = flops * factor / seconds
    return Compute(entry["key"], entry["device"], rate / width_eff, entry.get("source", ""))


def _intra(stride: int, size: int, lay: Layout) -> bool:
    return stride * size <= lay.gpus_per_node


def predict(shape: ModelShape, lay: Layout, compute: Compute, bw: Bandwidth,
            a: Assumptions = Assumptions()) -> Dict:
    """Milliseconds per iteration by part, tokens/s/GPU, TFLOP/s/GPU and MFU of ``shape`` on ``lay``."""
    lay.check(shape)
    tp, pp, vp, cp, dp, ep, m = lay.tp, lay.pp, lay.vp, lay.cp, lay.dp, lay.ep, lay.microbatches
    ms = 1e3
    layer_flops, head_flops = flops_split(shape, lay.mbs)
    rate = compute.rate * gemm_efficiency(shape.hidden / tp, a)
    redo = 4 / 3 if lay.recompute else 1.0
    t_layer = layer_flops * redo / (tp * cp) / rate * (1 + a.cp_overhead * (cp - 1) / cp)
    t_head = head_flops / (tp * cp) / rate
    stages = lay.stage_layers(shape)  # per pipeline rank: (transformer layers, runs the output layer)

    # Tensor parallelism: [s/CP, b, h] activations, per layer and micro-batch.
    act = shape.seq // cp * lay.mbs * shape.hidden * a.act_bytes
    tp_intra = _intra(1, tp, lay)
    if lay.sequence_parallel:
        # 4 forward + 4 backward exposed (an all-gather and a reduce-scatter cost the same); the 2 wgrad
        # re-gathers of the backward hide behind the dgrad GEMMs.
        # Full recompute repeats the forward's 4 in the backward.
        t_tp = (12 if lay.recompute else 8) * bw.seconds("all_gather", act, tp, tp_intra)
    else:
        t_tp = (6 if lay.recompute else 4) * bw.seconds("all_reduce", act, tp, tp_intra)
    if lay.tp_comm_overlap:
        t_tp *= 1 - a.tp_overlap_hidden

    # Context parallelism: the K/V ring, per layer and micro-batch; each step hides behind one attention block.
    t_cp = 0.0
    if cp > 1:
        kv = shape.seq // cp * lay.mbs * shape.kv_heads // tp * shape.head_dim * 2 * a.act_bytes
        step = bw.seconds("p2p", kv, 2, _intra(tp, cp, lay))
        attn_flops = 6 * shape.seq * shape.seq * shape.heads * shape.head_dim * lay.mbs  # causal, fwd+bwd
        block = attn_flops / (tp * cp * cp) / rate  # one of the cp x cp blocks
        # forward sends K,V (1 step's bytes), backward K,V,dK,dV (2): against 1/3 and 2/3 of a block's time.
        t_cp = (cp - 1) * (max(0.0, step - block / 3) + max(0.0, 2 * step - 2 * block / 3))

    # Expert parallelism: 4 all-to-alls of top-k copies of the rank's tokens per MoE layer and micro-batch.
    t_ep = 0.0
    if ep > 1:
        tokens = act / tp * shape.topk
        t_ep = 4 * bw.seconds("all_to_all", tokens, ep, _intra(tp * cp, ep, lay))
        if lay.ep_overlap and m > 1:
            # The forward's 2 all-to-alls hide behind the other micro-batch's backward of the layer (2/3 of its
            # compute), the backward's 2 behind the other's forward (1/3); the step's first forward and last
            # backward have no partner (1 in m micro-batches' exchanges stays exposed).
            paired = max(0.0, t_ep / 2 - t_layer * 2 / 3) + max(0.0, t_ep / 2 - t_layer / 3)
            t_ep = t_ep / m + paired * (m - 1) / m

    # Routing imbalance: the busiest EP rank's routed-expert GEMMs take moe_rank_load times the mean's.
    t_imbalance = 0.0
    if ep > 1 and lay.moe_rank_load > 1.0:
        _, experts_per_layer, _ = param_counts(shape)
        routed_flops = 6 * shape.seq * lay.mbs * experts_per_layer / shape.experts * shape.topk
        t_imbalance = (lay.moe_rank_load - 1.0) * routed_flops * redo / (tp * cp) / rate

    # The pipeline runs at its slowest rank's pace: its layers, plus the output layer and loss where it has them.
    layers_per_stage, has_head = max(stages, key=lambda st: st[0] * t_layer + (t_head if st[1] else 0.0))
    head = t_head if has_head else 0.0
    t_stage = max(n * (t_layer + t_tp + t_cp + t_ep + t_imbalance) + (t_head if h else 0.0) for n, h in stages)
    compute_per_mb = layers_per_stage * t_layer + head
    t_bubble = (pp - 1) / vp * t_stage
    t_p2p = 0.0
    if pp > 1 and vp == 1:
        p2p_bytes = act / (tp if lay.sequence_parallel else 1)
        t_p2p = 2 * m * bw.seconds("p2p", p2p_bytes, 2, _intra(tp * cp * dp, pp, lay))

    # Data parallelism over DP x CP (experts over DP x CP / EP) and the optimizer.
    dense, experts, embed = param_counts(shape)
    stage_embed = embed if pp == 1 else shape.vocab * shape.hidden  # input embedding or output layer
    dense_gpu = (layers_per_stage * dense + stage_embed) / tp
    expert_gpu = layers_per_stage * experts / (tp * ep)
    n_dp, n_edp = dp * cp, dp * cp // ep
    dp_intra = _intra(tp, n_dp, lay)

    def sync(params, n):
        if lay.dist_opt:
            return (bw.seconds("reduce_scatter", params * a.grad_bytes, n, dp_intra),
                    bw.seconds("all_gather", params * a.param_gather_bytes, n, dp_intra))
        return bw.seconds("all_reduce", params * a.grad_bytes, n, dp_intra), 0.0

    rs_d, ag_d = sync(dense_gpu, n_dp)
    rs_e, ag_e = sync(expert_gpu, n_edp)
    t_rs, t_ag = rs_d + rs_e, ag_d + ag_e
    bucket = max(a.bucket_params, 1e6 * n_dp)
    frac = min(1.0, bucket / max(dense_gpu + expert_gpu, 1.0))
    t_rs_exposed = max(t_rs * frac, t_rs - compute_per_mb * 2 / 3) if lay.overlap_grad_reduce else t_rs
    t_ag_exposed = max(t_ag * frac, t_ag - compute_per_mb / 3) if lay.overlap_param_gather else t_ag
    owned = (dense_gpu / n_dp + expert_gpu / n_edp) if lay.dist_opt else dense_gpu + expert_gpu
    t_opt = optimizer_seconds(owned, compute.device, a)

    parts = {"compute": m * compute_per_mb, "tp_exposed": m * layers_per_stage * t_tp,
             "cp_exposed": m * layers_per_stage * t_cp, "ep_all_to_all": m * layers_per_stage * t_ep,
             "moe_imbalance": m * layers_per_stage * t_imbalance,
             "pp_bubble": t_bubble, "pp_p2p": t_p2p, "dp_grad_reduce": t_rs_exposed,
             "dp_param_gather": t_ag_exposed, "optimizer": t_opt}
    iteration = sum(parts.values())
    flops = model_flops(shape, lay.gbs)
    tflops = flops / iteration / lay.gpus / 1e12
    return {"ms": {k: v * ms for k, v in parts.items()}, "iteration_ms": iteration * ms,
            "tokens_per_s_per_gpu": lay.gbs * shape.seq / iteration / lay.gpus, "tflops_per_gpu": tflops,
            "mfu": tflops / PEAK_TFLOPS[device_kind(compute.device)], "bubble_fraction": (pp - 1) / (m * vp),
            "dp": dp, "microbatches": m}


def bubble_fraction(pp: int, microbatches: int, vp: int = 1) -> float:
    """1F1B's idle share relative to the ideal time: (p - 1) / (m vp)."""
    return (pp - 1) / (microbatches * vp)


# ---------------------------------------------------------------- inputs and modes


def load_json(path: str) -> Dict:
    with open(path) as f:
        return json.load(f)


def load_bandwidth(path: Optional[str]) -> Bandwidth:
    """A measure-bandwidth JSON; the committed H100 measurement when none is named; the defaults without it."""
    if path is None and os.path.exists(BANDWIDTH):
        path = BANDWIDTH
    if path is None:
        return Bandwidth()
    data = load_json(path)
    data.setdefault("source", f"{os.path.relpath(path, ROOT)} ({data.get('device')}, {data.get('date')})")
    return Bandwidth(data)


def load_rows(path: str) -> Tuple[Dict[str, Compute], List[Dict], Dict]:
    """The calibration file: JSON {"compute": [...], "rows": [...]} or a CSV of rows (columns label, device,
    compute, model, measured_tokens_per_s_per_gpu, and layout fields) whose compute entries come from the
    committed JSON."""
    if path.endswith(".csv"):
        base = load_json(CALIBRATION)
        with open(path) as f:
            rows = [_csv_row(r) for r in csv.DictReader(f)]
        base["rows"] = rows
        data = base
    else:
        data = load_json(path)
    computes = {e["key"]: compute_from_measurement(e) for e in data.get("compute", [])}
    return computes, data.get("rows", []), data


def _csv_row(r: Dict) -> Dict:
    row = {k: r.pop(k) for k in ("label", "device", "compute", "model") if k in r}
    row["measured_tokens_per_s_per_gpu"] = float(r.pop("measured_tokens_per_s_per_gpu"))
    layout = {}
    for k, v in r.items():
        if v in ("", None):
            continue
        layout[k] = v.lower() == "true" if v.lower() in ("true", "false") else int(v)
    row["layout"] = layout
    return row


def measured_tokens(row: Dict, shape: ModelShape, lay: Layout) -> float:
    """A row's measured tokens/s/GPU (given directly, or from its TFLOP/s/GPU through Megatron's formula)."""
    if "measured_tokens_per_s_per_gpu" in row:
        return float(row["measured_tokens_per_s_per_gpu"])
    per_token = model_flops(shape, lay.gbs) / (lay.gbs * shape.seq)
    return row["measured_tflops_per_gpu"] * 1e12 / per_token


def evaluate(rows: List[Dict], computes: Dict[str, Compute], bw: Bandwidth) -> List[Dict]:
    """Prediction against measurement for each row, all with the same assumptions."""
    out = []
    for row in rows:
        shape, lay = shape_from(row["model"]), layout_from_dict(row["layout"])
        if row["compute"] not in computes:
            raise ValueError(f"row {row.get('label')!r}: compute {row['compute']!r} is not in the file's "
                             f"compute entries ({', '.join(computes)})")
        pred = predict(shape, lay, computes[row["compute"]], bw)
        measured = measured_tokens(row, shape, lay)
        out.append({"label": row.get("label", ""), "device": row.get("device", ""), "measured": measured,
                    "predicted": pred["tokens_per_s_per_gpu"],
                    "error": pred["tokens_per_s_per_gpu"] / measured - 1.0, "prediction": pred})
    return out


def _fmt_parts(pred: Dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in pred["ms"].items() if v >= 0.05)


def cmd_calibrate(args) -> int:
    computes, rows, _ = load_rows(args.rows)
    bw = load_bandwidth(args.bandwidth)
    results = evaluate(rows, computes, bw)
    print(f"bandwidth: {bw.source}; compute entries: " + "; ".join(
        f"{c.key} {c.rate / 1e12:.0f} TFLOP/s wide-GEMM rate" for c in computes.values()))
    print("| row | device | measured tokens/s/GPU | predicted | error |")
    print("|---|---|---|---|---|")
    for r in results:
        label = r["label"].replace("|", "\\|")  # a layout's stage separators inside a Markdown cell
        print(f"| {label} | {r['device']} | {r['measured']:,.0f} | {r['predicted']:,.0f} | "
              f"{100 * r['error']:+.1f}% |")
        if args.verbose:
            print(f"|   ms per iteration: {_fmt_parts(r['prediction'])} | | | | |")
    if results:
        errors = [abs(r["error"]) for r in results]
        print(f"mean |error| {100 * sum(errors) / len(errors):.1f}%, max {100 * max(errors):.1f}% over "
              f"{len(results)} rows")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def cmd_published(args) -> int:
    computes, _, data = load_rows(args.rows)
    key = args.compute or data.get("published_compute")
    if key not in computes:
        raise ValueError(f"--compute {key!r} is not a compute entry of {args.rows} ({', '.join(computes)})")
    bw = load_bandwidth(args.bandwidth)
    print(f"compute: {key} ({computes[key].source}); bandwidth: {bw.source}; inter-node "
          f"{Assumptions().inter_node_gbps:.0f} Gb/s per GPU x {Assumptions().inter_node_efficiency}")
    print("| configuration | published tokens/s/GPU | predicted | predicted / published | TFLOP/s/GPU | MFU |")
    print("|---|---|---|---|---|---|")
    for pub in PUBLISHED:
        pred = predict(PRESETS[pub.model], pub.layout, computes[key], bw)
        print(f"| {pub.label} | {pub.tokens_per_s_per_gpu:,.0f} | {pred['tokens_per_s_per_gpu']:,.0f} | "
              f"{pred['tokens_per_s_per_gpu'] / pub.tokens_per_s_per_gpu:.2f} | {pred['tflops_per_gpu']:.0f} | "
              f"{100 * pred['mfu']:.1f}% |")
        print(f"|   ms per iteration {pred['iteration_ms']:.0f}: {_fmt_parts(pred)} | | | | | |")
    return 0


def cmd_predict(args) -> int:
    computes, _, data = load_rows(args.rows)
    key = args.compute or data.get("published_compute")
    if key not in computes:
        raise ValueError(f"--compute {key!r} is not a compute entry of {args.rows} ({', '.join(computes)})")
    shape = shape_from(args.model)
    if args.layers or args.seq:
        shape = shape.with_(**{k: v for k, v in (("layers", args.layers), ("seq", args.seq)) if v})
    lay = Layout(gpus=args.gpus, gbs=args.gbs, mbs=args.mbs, tp=args.tp, pp=args.pp, vp=args.vp, cp=args.cp,
                 ep=args.ep, tp_comm_overlap=args.tp_comm_overlap, recompute=args.recompute,
                 gpus_per_node=args.gpus_per_node, sp=False if args.no_sequence_parallel else None,
                 dist_opt=not args.no_distributed_optimizer, overlap_grad_reduce=not args.no_overlap,
                 overlap_param_gather=not args.no_overlap, moe_rank_load=args.moe_rank_load,
                 ep_overlap=args.overlap_moe_expert_parallel_comm,
                 pp_layout=args.pp_layout)
    pred = predict(shape, lay, computes[key], load_bandwidth(args.bandwidth))
    print(f"{args.model} on {lay.gpus} GPUs (TP {lay.tp} PP {lay.pp} VP {lay.vp} CP {lay.cp} EP {lay.ep} DP "
          f"{lay.dp}, {pred['microbatches']} micro-batches): {pred['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
          f"{pred['tflops_per_gpu']:.0f} TFLOP/s/GPU, MFU {100 * pred['mfu']:.1f}%")
    print(f"ms per iteration {pred['iteration_ms']:.1f}: {_fmt_parts(pred)}")
    return 0


def cmd_measure(args) -> int:
    from tools import scaling_bandwidth  # lazy: imports torch.distributed only for this mode

    scaling_bandwidth.run(args.out, args.sizes_mb, args.warmup, args.iters)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--rows", default=CALIBRATION, help="calibration JSON (compute entries, measured rows) "
                        "or a CSV of rows")
    common.add_argument("--bandwidth", default=None, help="a measure-bandwidth JSON (default: the committed one)")
    common.add_argument("--compute", default=None, help="compute entry to use (default: the file's "
                        "published_compute)")
    c = sub.add_parser("calibrate", parents=[common], help="prediction vs measurement for each row")
    c.add_argument("--verbose", action="store_true", help="print each row's time by part")
    c.add_argument("--json", help="also write the results here")
    sub.add_parser("published", parents=[common], help="NVIDIA's published rows against the prediction")
    q = sub.add_parser("predict", parents=[common], help="one layout")
    q.add_argument("--model", default="LLAMA8B", help=f"preset: {', '.join(PRESETS)}")
    q.add_argument("--layers", type=int)
    q.add_argument("--seq", type=int)
    for name, default in (("gpus", 8), ("gbs", 128), ("mbs", 1), ("tp", 1), ("pp", 1), ("vp", 1), ("cp", 1),
                          ("ep", 1), ("gpus-per-node", 8)):
        q.add_argument(f"--{name}", type=int, default=default)
    q.add_argument("--tp-comm-overlap", action="store_true")
    q.add_argument("--no-sequence-parallel", action="store_true", help="TP without SP (all-reduces)")
    q.add_argument("--no-distributed-optimizer", action="store_true", help="DP all-reduce, unsharded optimizer")
    q.add_argument("--no-overlap", action="store_true", help="without --overlap-grad-reduce/--overlap-param-gather")
    q.add_argument("--recompute", action="store_true", help="full activation recompute")
    q.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                   help="with EP: each micro-batch's all-to-alls beside the other micro-batch's compute")
    q.add_argument("--moe-rank-load", type=float, default=1.0, help="with EP: the busiest rank's expert tokens "
                   "over the mean (the training log's `moe max rank load`; 1.0 = balanced)")
    q.add_argument("--pp-layout", help="--pipeline-model-parallel-layout, e.g. 'Et*17|t*15L' (its stages over PP "
                   "set --vp)")
    m = sub.add_parser("measure-bandwidth", help="bus bandwidth of the collectives (run under torchrun)")
    m.add_argument("--out", required=True)
    m.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256])
    m.add_argument("--warmup", type=int, default=3)
    m.add_argument("--iters", type=int, default=10)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return {"calibrate": cmd_calibrate, "published": cmd_published, "predict": cmd_predict,
            "measure-bandwidth": cmd_measure}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
