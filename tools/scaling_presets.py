"""Model shapes, layouts and default bandwidths for tools/scaling_model.py.

The shapes of ``../shared/megatron_reference/configs.sh`` (GPT13B, LLAMA8B, MOE_MIXTRAL, MOE_FINE, QWEN3_30B_A3B)
and of the published configurations (Llama-3-70B, GPT-3 175B), and NVIDIA's published rows the model is compared with.
"""
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as the FLOPs formula sees it (Megatron's flag names in the comments)."""
    layers: int  # --num-layers
    hidden: int  # --hidden-size
    ffn: int  # --ffn-hidden-size
    heads: int  # --num-attention-heads
    kv_heads: int  # --num-query-groups (= heads without GQA)
    vocab: int  # padded vocabulary (--vocab-size, a multiple of 128 here)
    seq: int  # --seq-length
    kv_channels: Optional[int] = None  # --kv-channels (default hidden / heads)
    swiglu: bool = True  # --swiglu (else GeLU: two FFN matrices)
    tied: bool = False  # embeddings tied with the output layer
    experts: int = 0  # --num-experts (0: dense)
    topk: int = 0  # --moe-router-topk
    moe_ffn: Optional[int] = None  # --moe-ffn-hidden-size
    shared_ffn: int = 0  # --moe-shared-expert-intermediate-size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    def with_(self, **changes) -> "ModelShape":
        return replace(self, **changes)


PRESETS: Dict[str, ModelShape] = {
    # GPT-2 style 1.3B (configs.sh GPT13B; tools/benchmark.py gpt-1.3b): LayerNorm, GeLU, tied, seq 2048.
    "GPT13B": ModelShape(layers=24, hidden=2048, ffn=8192, heads=16, kv_heads=16, vocab=50304, seq=2048,
                         swiglu=False, tied=True),
    # Llama-3-8B / 3.1-8B (configs.sh LLAMA8B): GQA 32/8, SwiGLU 14336, 128k vocab, untied, seq 8192.
    "LLAMA8B": ModelShape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, seq=8192,
                          kv_channels=128),
    # Llama-3-70B: 80 layers, 8192, GQA 64/8, SwiGLU 28672.
    "LLAMA70B": ModelShape(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256, seq=8192,
                           kv_channels=128),
    # GPT-3 175B: 96 layers, 12288, 96 heads, GeLU 4h, vocab 50257 padded to 51200, seq 2048.
    "GPT175B": ModelShape(layers=96, hidden=12288, ffn=49152, heads=96, kv_heads=96, vocab=51200, seq=2048,
                          swiglu=False, tied=True),
    # configs.sh MOE_MIXTRAL: 8 layers, 2048, GQA 16/4, 8 experts of 5632, top-2, seq 4096, vocab 32000.
    "MOE_MIXTRAL": ModelShape(layers=8, hidden=2048, ffn=5632, heads=16, kv_heads=4, vocab=32000, seq=4096,
                              experts=8, topk=2),
    # configs.sh MOE_FINE: the same with 64 experts of 1408, top-6, a shared expert of 2816.
    "MOE_FINE": ModelShape(layers=8, hidden=2048, ffn=5632, heads=16, kv_heads=4, vocab=32000, seq=4096,
                           experts=64, topk=6, moe_ffn=1408, shared_ffn=2816),
    # configs.sh QWEN3_30B_A3B (whole model: 48 layers; the rows cut it): 2048, GQA 32/4 of head dim 128, every
    # layer 128 experts of 768, top-8, no shared expert, vocab 151936, seq 4096.
    "QWEN3_30B_A3B": ModelShape(layers=48, hidden=2048, ffn=6144, heads=32, kv_heads=4, vocab=151936, seq=4096,
                                kv_channels=128, experts=128, topk=8, moe_ffn=768),
}


@dataclass(frozen=True)
class Layout:
    """How a run is spread over ``gpus`` GPUs (Megatron's order tp-cp-ep-dp-pp: TP ranks adjacent)."""
    gpus: int
    gbs: int  # --global-batch-size
    mbs: int = 1  # --micro-batch-size
    tp: int = 1
    pp: int = 1
    vp: int = 1  # model chunks per pipeline stage (--num-virtual-stages-per-pipeline-rank)
    cp: int = 1
    ep: int = 1
    sp: Optional[bool] = None  # sequence parallelism; default on when tp > 1
    dist_opt: bool = True  # --use-distributed-optimizer
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False
    recompute: bool = False  # full activation recompute (one more forward per layer)
    gpus_per_node: int = 8
    # With EP: the busiest EP rank's expert tokens over the mean per rank (the log's `moe max rank load`);
    # 1.0 = balanced routing. The other ranks wait for that one in each MoE layer's combine all-to-all.
    moe_rank_load: float = 1.0
    # --overlap-moe-expert-parallel-comm: each MoE layer's all-to-alls of one micro-batch run beside the other
    # micro-batch's compute of that layer (the forward's beside the backward's, and back); needs m >= 2.
    ep_overlap: bool = False
    # --pipeline-model-parallel-layout (e.g. "Et*17|t*15L"): each stage's layers, where the output layer's stage
    # may hold fewer; its entries over PP set VP. None: the even split, the output layer on the last stage.
    pp_layout: Optional[str] = None

    def stage_layers(self, shape: "ModelShape") -> List[Tuple[int, bool]]:
        """Per pipeline rank: its transformer layers (over all its virtual stages) and whether it runs the
        output layer and loss."""
        if self.pp_layout is None:
            return [(shape.layers // self.pp, r == self.pp - 1) for r in range(self.pp)]
        from megatron.core.transformer.enums import LayerType  # lazy: only layouts need the parser (torch)
        from megatron.core.transformer.pipeline_parallel_layer_layout import (  # lazy: as above
            PipelineParallelLayerLayout,
        )
        parsed = PipelineParallelLayerLayout(self.pp_layout, self.pp)
        return [(sum(stage.count(LayerType.decoder) for stage in rank), any(LayerType.loss in s for s in rank))
                for rank in parsed.layout]

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def microbatches(self) -> int:
        return self.gbs // (self.mbs * self.dp)

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sp is None else self.sp

    def check(self, shape: ModelShape) -> None:
        """One clear line per inconsistent layout (the same conditions Megatron's validation enforces)."""
        denom = self.tp * self.pp * self.cp
        if self.gpus % denom:
            raise ValueError(f"layout: {self.gpus} GPUs are not a multiple of TP x PP x CP = {denom}")
        if self.gbs % (self.mbs * self.dp):
            raise ValueError(f"layout: global batch {self.gbs} is not a multiple of micro-batch {self.mbs} x DP "
                             f"{self.dp}")
        if self.pp_layout is not None:
            from megatron.core.transformer.pipeline_parallel_layer_layout import (  # lazy: torch, for layouts only
                PipelineParallelLayerLayout,
            )
            parsed = PipelineParallelLayerLayout(self.pp_layout, self.pp)
            parsed.validate_layer_layout(shape.layers)
            if parsed.virtual_pipeline_model_parallel_size != self.vp:
                vp = parsed.virtual_pipeline_model_parallel_size
                raise ValueError(f"layout: pp_layout {self.pp_layout!r} has {vp} stages per rank; set vp to that "
                                 f"({self.vp} given)")
        elif shape.layers % (self.pp * self.vp):
            raise ValueError(f"layout: {shape.layers} layers do not split into PP {self.pp} x VP {self.vp} chunks")
        if shape.heads % self.tp or shape.kv_heads % self.tp:
            raise ValueError(f"layout: TP {self.tp} does not divide the {shape.heads} heads / {shape.kv_heads} "
                             "KV groups")
        if self.ep > 1 and (not shape.experts or (self.dp * self.cp) % self.ep or shape.experts % self.ep):
            raise ValueError(f"layout: EP {self.ep} needs an MoE model whose experts and DP x CP it divides")
        if self.vp > 1 and self.pp == 1:
            raise ValueError("layout: VP > 1 needs PP > 1")
        if self.moe_rank_load < 1.0:
            raise ValueError(f"layout: moe_rank_load {self.moe_rank_load} is below 1.0 (the busiest rank carries at "
                             "least the mean)")


def layout_from_dict(d: Dict) -> Layout:
    known = set(Layout.__dataclass_fields__)
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"layout: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    return Layout(**d)


def shape_from(model) -> ModelShape:
    """A preset name, or a dict {"preset": NAME, <field>: value, ...} / a dict of every field."""
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"model: unknown preset {model!r}; presets: {', '.join(PRESETS)}")
        return PRESETS[model]
    model = dict(model)
    base = model.pop("preset", None)
    return shape_from(base).with_(**model) if base else ModelShape(**model)


# Intra-node bus bandwidth (GB/s, nccl-tests convention) used when no measured JSON is given: NVLink 4 on
# an HGX H100/H200 board as nccl-tests commonly reports it for large messages (~360-480 GB/s; the
# lower end is taken), with a latency floor for small ones (see scaling_model.Bandwidth). A measured
# file (measure-bandwidth) replaces these.
DEFAULT_INTRA_BUSBW_GBPS = {"all_reduce": 360.0, "all_gather": 360.0, "reduce_scatter": 360.0,
                            "all_to_all": 300.0, "p2p": 360.0}


@dataclass(frozen=True)
class Published:
    label: str
    model: str
    layout: Layout
    tokens_per_s_per_gpu: float
    device: str = "H100"
    notes: str = field(default="")


# NVIDIA's published rows (Megatron Core + Transformer Engine, BF16), as quoted in issue 38.
PUBLISHED = [
    Published("Llama-3.1-8B, 8 x H100, TP1 CP2, seq 8192, mbs 1, gbs 128", "LLAMA8B",
              Layout(gpus=8, gbs=128, mbs=1, cp=2), 10682.0),
    Published("Llama-3-70B, 64 x H100, TP4 PP4 CP2 VP5, seq 8192, mbs 1, gbs 128", "LLAMA70B",
              Layout(gpus=64, gbs=128, mbs=1, tp=4, pp=4, vp=5, cp=2, tp_comm_overlap=True), 1118.0,
              notes="gbs 128 assumed (NeMo's recipe)"),
    Published("GPT-3 175B, 128 x H100, TP4 PP8 VP12, seq 2048, mbs 1, gbs 256", "GPT175B",
              Layout(gpus=128, gbs=256, mbs=1, tp=4, pp=8, vp=12, tp_comm_overlap=True), 493.0,
              notes="gbs 256 assumed (NeMo's recipe at 128 GPUs)"),
]
