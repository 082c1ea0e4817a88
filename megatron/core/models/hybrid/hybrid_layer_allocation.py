"""Hybrid layer patterns (Megatron's syntax): one character per layer, '|' between pipeline segments,
'/' before each multi-token-prediction depth's pattern.

    M Mamba-2   G Gated DeltaNet   * attention   + multi-latent attention   - MLP   E MoE
    e.g. "M-M*-|M-M*-/*-/*-"

Errors are one line naming the symbol and its position (0-based, in the whole pattern string).
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


class Symbols:
    """Layer symbols and separators (Megatron's names)."""

    MAMBA = "M"
    GDN = "G"
    ATTENTION = "*"
    DS_ATTENTION = "D"
    MLA = "+"
    MLP = "-"
    MOE = "E"
    PIPE = "|"
    MTP_SEPARATOR = "/"
    VALID_LAYERS = {MAMBA, GDN, ATTENTION, DS_ATTENTION, MLA, MLP, MOE}
    # Megatron symbols whose layers are not built here yet, with what to use instead.
    NOT_BUILT = {DS_ATTENTION: "DeepSeek sparse attention layers are not supported yet"}

    @classmethod
    def name_sorted_valid_layer_symbols(cls) -> List[str]:
        """The layer symbols ordered by their attribute names (Megatron's order for layer maps)."""
        named = sorted((name, value) for name, value in vars(cls).items()
                       if not name.startswith("_") and isinstance(value, str) and value in cls.VALID_LAYERS)
        return [value for _, value in named]


@dataclass
class ParsedHybridPattern:
    """A pattern split into the main decoder part (with its '|' markers) and the per-depth MTP part."""

    main_pattern: Optional[str]
    mtp_pattern: Optional[str]
    mtp_num_depths: int


def _check_symbols(pattern: str, start: int, allow_pipe: bool, flag: str) -> None:
    for i, char in enumerate(pattern):
        if char == Symbols.PIPE and allow_pipe:
            continue
        if char not in Symbols.VALID_LAYERS:
            where = "an MTP pattern" if not allow_pipe and char == Symbols.PIPE else f"position {start + i}"
            raise ValueError(f"{flag}: '{char}' at {where} is not a layer symbol; use M (Mamba-2), G (Gated "
                             "DeltaNet), * (attention), - (MLP), E (MoE), '|' between pipeline stages and '/' "
                             "before MTP depths")
        if char in Symbols.NOT_BUILT:
            raise ValueError(f"{flag}: '{char}' at position {start + i}: {Symbols.NOT_BUILT[char]}")


def parse_hybrid_pattern(pattern: Optional[str], flag: str = "--hybrid-layer-pattern") -> ParsedHybridPattern:
    """Split and check ``pattern`` ("<main>/<mtp>/<mtp>..."); every MTP depth must repeat one pattern."""
    if pattern is None:
        return ParsedHybridPattern(None, None, 0)
    main, *mtp_parts = pattern.split(Symbols.MTP_SEPARATOR)
    _check_symbols(main, 0, True, flag)
    start = len(main) + 1
    for part in mtp_parts:
        _check_symbols(part, start, False, flag)
        start += len(part) + 1
    mtp_parts = [p for p in mtp_parts if p]
    if mtp_parts and any(p != mtp_parts[0] for p in mtp_parts):
        raise ValueError(f"{flag}: every MTP depth must have the same pattern, got {mtp_parts}")
    return ParsedHybridPattern(main or None, mtp_parts[0] if mtp_parts else None, len(mtp_parts))


def get_hybrid_total_layer_count(pattern: str) -> int:
    """Number of main decoder layers ('|' and the MTP part not counted)."""
    main = parse_hybrid_pattern(pattern).main_pattern or ""
    return len(main.replace(Symbols.PIPE, ""))


def get_hybrid_total_pipeline_segment_count(pattern: str) -> int:
    """Number of '|'-separated segments of the main pattern."""
    return pattern.split(Symbols.MTP_SEPARATOR)[0].count(Symbols.PIPE) + 1


def get_hybrid_layer_counts(pattern: str) -> Dict[str, int]:
    """{symbol: count} over the main pattern and every MTP depth."""
    parsed = parse_hybrid_pattern(pattern)
    counts = {s: 0 for s in Symbols.name_sorted_valid_layer_symbols()}
    for char in (parsed.main_pattern or "").replace(Symbols.PIPE, ""):
        counts[char] += 1
    for char in parsed.mtp_pattern or "":
        counts[char] += parsed.mtp_num_depths
    return counts


def validate_segment_layers(segment: str) -> List[str]:
    """The layer symbols of one pipeline segment, checked."""
    _check_symbols(segment, 0, False, "hybrid layer pattern segment")
    return list(segment)


def select_pipeline_segment(main_pattern: str, pp_rank: int, pp_size: int, vp_stage: Optional[int] = None,
                            first_stage_layers: Optional[int] = None,
                            last_stage_layers: Optional[int] = None) -> Tuple[List[str], int]:
    """(layer symbols, global offset of the first) of the part of ``main_pattern`` this pipeline rank (and
    virtual stage) builds. With '|' markers: segment vp_stage * pp_size + pp_rank. Without: the layers split
    evenly over the stages, or by the first/last stage counts."""
    segments = main_pattern.split(Symbols.PIPE)
    if len(segments) > 1:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise ValueError("--decoder-first/last-pipeline-num-layers cannot be combined with '|' in "
                             "--hybrid-layer-pattern: the '|' markers already place the layers")
        if len(segments) % pp_size:
            raise ValueError(f"--hybrid-layer-pattern has {len(segments)} '|'-separated segments, not a multiple "
                             f"of --pipeline-model-parallel-size ({pp_size})")
        index = (vp_stage or 0) * pp_size + pp_rank
        if index >= len(segments):
            raise ValueError(f"--hybrid-layer-pattern has {len(segments)} segments; pipeline rank {pp_rank} at "
                             f"virtual stage {vp_stage} needs segment {index}")
        return validate_segment_layers(segments[index]), sum(len(s) for s in segments[:index])
    if vp_stage is not None and pp_size > 1:
        raise ValueError("--num-layers-per-virtual-pipeline-stage with a hybrid model needs '|' markers in "
                         "--hybrid-layer-pattern (one segment per virtual stage)")
    layers = validate_segment_layers(main_pattern)
    n = len(layers)
    if first_stage_layers is None and last_stage_layers is None:
        if n % pp_size:
            raise ValueError(f"--hybrid-layer-pattern has {n} layers, not divisible by "
                             f"--pipeline-model-parallel-size ({pp_size}); add '|' markers to place them")
        count = n // pp_size
        return layers[pp_rank * count:(pp_rank + 1) * count], pp_rank * count
    first, last = first_stage_layers or 0, last_stage_layers or 0
    middle_stages = pp_size - (first_stage_layers is not None) - (last_stage_layers is not None)
    middle = n - first - last
    if middle_stages > 0 and middle % middle_stages:
        raise ValueError(f"{middle} layers between the first and last pipeline stages do not divide over "
                         f"{middle_stages} middle stages")
    per_middle = middle // middle_stages if middle_stages > 0 else 0
    if first_stage_layers is not None and pp_rank == 0:
        return layers[:first], 0
    if last_stage_layers is not None and pp_rank == pp_size - 1:
        return layers[n - last:], n - last
    offset = first + (pp_rank - (first_stage_layers is not None)) * per_middle
    return layers[offset:offset + per_middle], offset


def get_layer_maps_from_layer_type_list(layer_type_list: List[str]) -> Dict[str, Dict[int, int]]:
    """{symbol: {global layer index: index among the layers of that symbol}}."""
    maps = {s: {} for s in Symbols.name_sorted_valid_layer_symbols()}
    for i, symbol in enumerate(layer_type_list):
        maps[symbol][i] = len(maps[symbol])
    return maps


def pattern_from_ratios(num_layers: int, attention_ratio: float = 0.0, mlp_ratio: float = 0.0) -> str:
    """An evenly spaced pattern from Megatron's deprecated ratios (attention and MLP layers spread among
    Mamba layers)."""
    if not (num_layers > 0 and 0.0 <= attention_ratio and 0.0 <= mlp_ratio and attention_ratio + mlp_ratio <= 1.0):
        raise ValueError("hybrid ratios must be in [0, 1] with attention + MLP <= 1, and num_layers > 0")
    layers = [Symbols.MAMBA] * num_layers
    n_attn = round(num_layers * attention_ratio)
    _spread(layers, n_attn, Symbols.ATTENTION, num_layers - n_attn)
    n_mlp = round(num_layers * mlp_ratio)
    if n_mlp:
        _spread(layers, n_mlp, Symbols.MLP, num_layers - n_attn - n_mlp)
    return "".join(layers)


def _spread(layers: List[str], count: int, symbol: str, others: int) -> None:
    """Replace ``count`` Mamba layers by ``symbol`` at even spacing, ``others`` Mamba layers kept between."""
    if count == 0:
        return
    gap = others / (count + 1) if symbol == Symbols.ATTENTION else others / count
    budget = gap
    for i, current in enumerate(layers):
        if current != Symbols.MAMBA:
            continue
        if budget < 0.5:
            layers[i] = symbol
            budget += gap
        else:
            budget -= 1
