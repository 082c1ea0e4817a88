"""``--pipeline-model-parallel-layout``: which layers each pipeline (virtual) stage holds, written out.

The even split and ``--decoder-first/last-pipeline-num-layers`` give every stage but the first and last the same
number of transformer layers. A layout names each stage's layers instead, so a stage can carry fewer layers where
it also runs the embedding or the output layer and loss (Llama-3's 128k-vocabulary head costs about 2 of its
layers), or none at all. The string has one entry per stage, ``|`` between stages, in the interleaved schedule's
order (stage ``i`` is virtual stage ``i // PP`` of pipeline rank ``i % PP``, so ``PP x VP`` entries set the
virtual stages per rank):

    E  the embedding (first entry only)     t  a transformer layer     m  an MTP layer     L  the loss (last)
    x*n repeats x; (...)*n repeats a group, stage separators included; commas are ignored.

    "Et*9|t*9|t*9|t*5L"      PP=4, the last stage 4 layers lighter for the output layer
    "Ett|tt|tt|ttL"          PP=2 with 2 virtual stages per rank (4 entries)
    "E|(t*4|)*7t*4L"         PP=3 x 3 virtual stages: the embedding alone, then 8 stages of 4 layers

The embedding and the loss stay on the first and the last stage (as in Megatron Core); MTP layers, when the
model has them, sit with the loss on the last stage, where they are built here.
"""
import re
from typing import List, Optional, Union

from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType

_SYMBOLS = {"E": LayerType.embedding, "L": LayerType.loss, "t": LayerType.decoder, "m": LayerType.mtp}
_NAMES = {v: k for k, v in _SYMBOLS.items()}


class PipelineParallelLayerLayout:
    """A parsed layout: ``layout[pp_rank][vp_stage]`` is the list of that stage's LayerTypes."""

    def __init__(self, layout: Union[str, List[list]], pipeline_model_parallel_size: int):
        self.input_data = layout
        stages = self.parse_str_to_list(layout) if isinstance(layout, str) else [list(s) for s in layout]
        pp = pipeline_model_parallel_size
        if pp < 1 or len(stages) % pp:
            raise ValueError(f"--pipeline-model-parallel-layout has {len(stages)} stages, not a multiple of "
                             f"--pipeline-model-parallel-size ({pp}): write PP x (virtual stages per rank) entries")
        vp = len(stages) // pp
        stages = [[_layer_type(x) for x in stage] for stage in stages]
        self.pipeline_model_parallel_size = pp
        self.virtual_pipeline_model_parallel_size = vp
        self.layout = [[stages[v * pp + p] for v in range(vp)] for p in range(pp)]
        self.flatten_layout = [x for v in range(vp) for p in range(pp) for x in self.layout[p][v]]

    def __repr__(self) -> str:
        return self.input_data if isinstance(self.input_data, str) else str(self.input_data)

    @staticmethod
    def parse_str_to_list(layout: str) -> List[List[LayerType]]:
        """``"Et*2|(tt|)*2L"`` -> [[E, t, t], [t, t], [t, t, L]]: repetitions unrolled, commas dropped."""
        text = layout.replace(",", "").replace(" ", "")
        group = re.compile(r"\(([^()]*)\)\*(\d+)")
        while group.search(text):
            text = group.sub(lambda m: m.group(1) * int(m.group(2)), text)
        text = re.sub(r"([^|()])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
        bad = sorted(set(text) - set(_SYMBOLS) - {"|"})
        if bad:
            raise ValueError(f"--pipeline-model-parallel-layout {layout!r}: unknown symbol(s) {bad}; use E "
                             "(embedding), t (transformer layer), m (MTP layer), L (loss), x*n, (...)*n and |")
        return [[_SYMBOLS[c] for c in stage] for stage in text.split("|")]

    @staticmethod
    def from_str(layout: str, pipeline_model_parallel_size: int) -> "PipelineParallelLayerLayout":
        return PipelineParallelLayerLayout(layout, pipeline_model_parallel_size)

    @staticmethod
    def get_num_stages_from_str(layout: str) -> int:
        return len(PipelineParallelLayerLayout.parse_str_to_list(layout))

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: Optional[int] = None) -> bool:
        """Raise ValueError unless the layout holds the model: the embedding first and the loss last, once
        each, ``num_layers`` transformer layers and the MTP layers with the loss. Returns False (MTP is never
        on a stage of its own here; Megatron's 'standalone MTP' flag)."""
        flat, name = self.flatten_layout, f"--pipeline-model-parallel-layout {self!r}"
        if flat.count(LayerType.embedding) != 1 or flat[0] != LayerType.embedding:
            raise ValueError(f"{name}: the embedding (E) must open the first stage, once")
        if flat.count(LayerType.loss) != 1 or flat[-1] != LayerType.loss:
            raise ValueError(f"{name}: the loss (L) must close the last stage, once")
        if LayerType.encoder in flat:
            raise ValueError(f"{name}: encoder layers have no place in a GPT layout")
        decoders = flat.count(LayerType.decoder)
        if decoders != num_layers:
            raise ValueError(f"{name} places {decoders} transformer layers (t); --num-layers is {num_layers}")
        mtp = flat.count(LayerType.mtp)
        if mtp != (mtp_num_layers or 0):
            raise ValueError(f"{name} places {mtp} MTP layers (m); --mtp-num-layers is {mtp_num_layers or 0}")
        last = self.layout[-1][-1]
        if mtp and (last.count(LayerType.mtp) != mtp or LayerType.decoder in last[last.index(LayerType.mtp):]):
            raise ValueError(f"{name}: MTP layers (m) are built on the last stage, after its transformer layers "
                             "and before the loss; a stage of their own is not supported")
        return False

    def _coords(self, vp_stage: Optional[int], pp_rank: Optional[int]):
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        if vp_stage is None:
            vp_stage = parallel_state.get_virtual_pipeline_model_parallel_rank() or 0
        return vp_stage, pp_rank

    def get_num_layers_to_build(self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None,
                                pp_rank: Optional[int] = None) -> int:
        vp_stage, pp_rank = self._coords(vp_stage, pp_rank)
        return self.layout[pp_rank][vp_stage].count(layer_type)

    def get_layer_offset(self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None,
                         pp_rank: Optional[int] = None) -> int:
        """How many layers of ``layer_type`` come before this stage, in the interleaved order."""
        vp_stage, pp_rank = self._coords(vp_stage, pp_rank)
        pp = self.pipeline_model_parallel_size
        before = [self.layout[p][v] for v in range(vp_stage + 1) for p in range(pp if v < vp_stage else pp_rank)]
        return sum(stage.count(layer_type) for stage in before)

    def get_layer_id_list(self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None,
                          pp_rank: Optional[int] = None) -> List[int]:
        start = self.get_layer_offset(layer_type, vp_stage, pp_rank)
        return list(range(start, start + self.get_num_layers_to_build(layer_type, vp_stage, pp_rank)))

    def decoder_counts(self) -> List[List[int]]:
        """counts[vp][pp]: transformer layers of virtual stage ``vp`` of pipeline rank ``pp``."""
        return [[self.layout[p][v].count(LayerType.decoder) for p in range(self.pipeline_model_parallel_size)]
                for v in range(self.virtual_pipeline_model_parallel_size)]

    def pretty_repr(self) -> str:
        """One line per pipeline rank, one column per virtual stage, e.g. ``PP rank 0: E,t*9``."""
        def stage(s):
            runs = []
            for x in s:
                if runs and runs[-1][0] == x:
                    runs[-1][1] += 1
                else:
                    runs.append([x, 1])
            return ",".join(_NAMES[x] + (f"*{n}" if n > 1 else "") for x, n in runs) or "(empty)"
        return "\n".join(f"PP rank {p}: " + " | ".join(stage(s) for s in row) for p, row in enumerate(self.layout))


def _layer_type(x) -> LayerType:
    if isinstance(x, LayerType):
        return x
    if isinstance(x, str) and x in _SYMBOLS:
        return _SYMBOLS[x]
    if isinstance(x, str) and x.strip().lower() in LayerType.__members__:
        return LayerType[x.strip().lower()]
    raise ValueError(f"--pipeline-model-parallel-layout: {x!r} is not a layer (E, t, m, L or a LayerType name)")
