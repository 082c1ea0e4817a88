"""Which transformer layers a pipeline (virtual) stage builds, and the global index of its first one.

Layer assignment: each PP rank gets an equal share (or the uneven first/last counts), split further
into ``vpp`` virtual chunks (or each chunk's count as ``--pipeline-model-parallel-layout`` writes it);
chunks are numbered virtual-stage-major, so with PP=2, VPP=2 and 8 layers rank 0 builds layers 0-1 and
4-5, rank 1 builds 2-3 and 6-7 (as Megatron interleaves). Both the block (how many layers to build) and each
layer (its global ``layer_number``) read it.
"""
from typing import List, Optional

from megatron.core import parallel_state


def layers_per_pipeline_rank(config, pp_size: int) -> List[int]:
    """Layer slots per PP rank (including the virtual embedding/loss slots when accounted for).

    ``config`` needs num_layers, num_layers_in_first/last_pipeline_stage and the two
    account_for_*_in_pipeline_split fields. Raises ValueError when the layers do not split."""
    n = config.num_layers
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        n += int(config.account_for_embedding_in_pipeline_split) + int(config.account_for_loss_in_pipeline_split)
        if n % pp_size:
            raise ValueError(f"num_layers ({config.num_layers}, {n} with embedding/loss slots) must be divisible "
                             f"by --pipeline-model-parallel-size ({pp_size}); or set "
                             "--decoder-first/last-pipeline-num-layers")
        return [n // pp_size] * pp_size
    middle_ranks = pp_size - (first is not None) - (last is not None)
    middle_layers = n - (first or 0) - (last or 0)
    if middle_ranks < 0 or middle_layers < 0:
        raise ValueError("--decoder-first/last-pipeline-num-layers exceed num_layers or the pipeline size")
    if middle_ranks == 0 and middle_layers != 0 or middle_ranks and middle_layers % middle_ranks:
        raise ValueError(f"the {middle_layers} layers left after the first/last stage counts do not split "
                         f"evenly over {middle_ranks} middle pipeline stages")
    per_middle = middle_layers // middle_ranks if middle_ranks else 0
    counts = [per_middle] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def _chunk_counts(config, pp_size: Optional[int] = None) -> List[List[int]]:
    """counts[vp][pp] = layers built by virtual chunk ``vp`` of PP rank ``pp`` (``pp_size``: parallel_state's
    pipeline size when None)."""
    pp_size = parallel_state.get_pipeline_model_parallel_world_size() if pp_size is None else pp_size
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:  # --pipeline-model-parallel-layout names each stage's layers
        if layout.pipeline_model_parallel_size != pp_size:
            raise ValueError(f"the pipeline layout is for {layout.pipeline_model_parallel_size} pipeline ranks; "
                             f"this pipeline has {pp_size}")
        return layout.decoder_counts()
    vp_size = config.virtual_pipeline_model_parallel_size or 1
    per_rank = layers_per_pipeline_rank(config, pp_size)
    for r, c in enumerate(per_rank):
        if c % vp_size:
            raise ValueError(f"pipeline rank {r} has {c} layer slots, not divisible by "
                             f"--num-virtual-stages-per-pipeline-rank ({vp_size})")
    counts = [[c // vp_size for c in per_rank] for _ in range(vp_size)]
    if config.account_for_embedding_in_pipeline_split:
        counts[0][0] -= 1
    if config.account_for_loss_in_pipeline_split:
        counts[-1][-1] -= 1
    if min(min(row) for row in counts) < 0 or sum(map(sum, counts)) != config.num_layers:
        raise ValueError(f"pipeline layer split {counts} does not cover num_layers={config.num_layers}")
    return counts


def _vp(vp_stage: Optional[int]) -> int:
    if vp_stage is not None:
        return vp_stage
    return parallel_state.get_virtual_pipeline_model_parallel_rank() or 0


def get_num_layers_to_build(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                            pp_size: Optional[int] = None) -> int:
    """Number of transformer layers in this rank's (virtual) stage (``pp_rank`` / ``pp_size``: a pipeline
    on explicit groups; parallel_state's when None)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    return _chunk_counts(config, pp_size)[_vp(vp_stage)][pp_rank]


def get_transformer_layer_offset(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                                 pp_size: Optional[int] = None) -> int:
    """Global index of this stage's first layer: all layers of the chunks before it (virtual-stage-major)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    counts = _chunk_counts(config, pp_size)
    vp = _vp(vp_stage)
    return sum(map(sum, counts[:vp])) + sum(counts[vp][:pp_rank])


def pipeline_coords(pg_collection, owner: str) -> dict:
    """``pp_rank`` / ``pp_size`` of an explicit collection's pipeline group for the two functions above
    (no keywords without a collection: parallel_state's)."""
    if pg_collection is None:
        return {}
    pp = pg_collection.pp
    if pp is None:
        raise ValueError(f"{owner}: the explicit pg_collection has no 'pp' group, which places its layers; set "
                         "it (a one-rank group without pipelining)")
    return {"pp_rank": pp.rank(), "pp_size": pp.size()}
