"""Hybrid layer patterns: parsing, counts, the pipeline split and one-line errors."""
import pytest

from megatron.core.models.hybrid.hybrid_layer_allocation import (
    get_hybrid_layer_counts,
    get_hybrid_total_layer_count,
    get_hybrid_total_pipeline_segment_count,
    parse_hybrid_pattern,
    pattern_from_ratios,
    select_pipeline_segment,
)


def test_parse_main_pipes_and_mtp():
    parsed = parse_hybrid_pattern("M-M*|GE-*/*-/*-")
    assert (parsed.main_pattern, parsed.mtp_pattern, parsed.mtp_num_depths) == ("M-M*|GE-*", "*-", 2)
    assert get_hybrid_total_layer_count("M-M*|GE-*/*-/*-") == 8
    assert get_hybrid_total_pipeline_segment_count("M-M*|GE-*") == 2
    counts = get_hybrid_layer_counts("M-M*|GE-*/*-/*-")
    assert counts["M"] == 2 and counts["*"] == 4 and counts["-"] == 4 and counts["G"] == 1 and counts["E"] == 1


@pytest.mark.parametrize("pattern, message", [
    ("MMX*", "'X' at position 2 is not a layer symbol"),
    ("M*/M|", "'|' at an MTP pattern"),
    ("M*D", "'D' at position 2: DeepSeek sparse attention"),
    ("M*/*-/-*", "every MTP depth must have the same pattern"),
])
def test_bad_patterns_are_one_line(pattern, message):
    with pytest.raises(ValueError, match="--hybrid-layer-pattern") as e:
        parse_hybrid_pattern(pattern)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_pipeline_segments_from_pipes_and_even_split():
    assert select_pipeline_segment("M-M*|GE", 0, 2) == (list("M-M*"), 0)
    assert select_pipeline_segment("M-M*|GE", 1, 2) == (list("GE"), 4)
    assert select_pipeline_segment("M-|M*|GE|--", 1, 2, vp_stage=1) == (list("--"), 6)
    assert select_pipeline_segment("M-M*GE", 1, 2) == (list("*GE"), 3)
    assert select_pipeline_segment("M-M*GE", 0, 2, first_stage_layers=2) == (list("M-"), 0)
    assert select_pipeline_segment("M-M*GE", 1, 2, first_stage_layers=2) == (list("M*GE"), 2)
    with pytest.raises(ValueError, match="not divisible by --pipeline-model-parallel-size"):
        select_pipeline_segment("M-M*G", 0, 2)
    with pytest.raises(ValueError, match="not a multiple of --pipeline-model-parallel-size"):
        select_pipeline_segment("M-|M*|G", 0, 2)


def test_pattern_from_ratios_spreads_layers():
    pattern = pattern_from_ratios(8, attention_ratio=0.25, mlp_ratio=0.25)
    assert len(pattern) == 8 and pattern.count("*") == 2 and pattern.count("-") == 2
    assert not pattern.startswith("*")
