"""The Megatron flag registry: every Megatron-LM 0.19.2 flag parses; statuses behave as documented."""
import argparse
import os

import pytest

import pretrain_bert
import pretrain_t5
from megatron.training.arguments import ArgumentError, build_parser, megatron_flags_docs, parse_args, validate_args
from megatron.training.arguments import megatron_flags as mf

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --train-iters 5 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128").split()
EXAMPLES = os.path.join(os.path.dirname(__file__), "megatron_flags_in_examples.txt")
SPECS = mf.load_specs()
PARSER = build_parser()
ACTIONS = {o: a for a in PARSER._actions for o in a.option_strings}


def _validate(argv, parser=PARSER):
    args = parser.parse_args(BASE + argv)
    args.rank, args.world_size = 0, 1
    return validate_args(args)


def _sample_value(action):
    """A value the action accepts: its default, else its first choice, else one of its type."""
    if action.nargs == 0:
        return []
    value = action.default if action.default not in (None, argparse.SUPPRESS, []) else (
        action.choices[0] if action.choices else {int: 1, float: 1.0}.get(action.type, "1"))
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if action.nargs is None:
        values = values[:1]
    return [str(v) for v in values]


def test_every_option_string_is_recognized():
    """One argv holding every option string of the tsv, hence every pretrain flag of Megatron's examples, parses.

    The examples file also counts flags of other programs (torchrun, srun, nsys, inference and export
    scripts), names cut at an underscore (`--use-checkpoint-opt`) and flags newer than 0.19.2: 413 of its
    629 names are flags of Megatron 0.19.2's training parser."""
    examples = [line.split()[1] for line in open(EXAMPLES) if not line.startswith("#")]
    options = {o for spec in SPECS for o in spec.options if o not in ("-h", "--help")}
    assert len(set(examples) & options) == 413
    argv = []
    for option in sorted(options):
        argv += [option] + _sample_value(ACTIONS[option])
    args, unknown = PARSER.parse_known_args(argv)
    assert unknown == []


def test_every_flag_at_its_default_validates():
    """Every flag that takes a value, passed explicitly at its default, parses back to it and validates."""
    argv, expected = [], {}
    for spec in SPECS:
        action = ACTIONS[spec.options[0]]
        if spec.action != "Store" or action.default in (None, argparse.SUPPRESS) or action.dest in expected:
            continue
        if action.default == [] or spec.options[0] in BASE:  # [] cannot be spelled on a command line
            continue
        argv += [spec.options[0]] + _sample_value(action)
        expected[action.dest] = action.default
    args = PARSER.parse_args(BASE + argv)
    for dest, default in expected.items():
        assert mf.is_default(getattr(args, dest), default), (dest, getattr(args, dest))
    args.rank, args.world_size = 0, 1
    validate_args(args)


@pytest.mark.parametrize("argv,needle", [
    ("--perform-rl-step", "--perform-rl-step is not supported yet: RL training is not part of this project"),
    ("--grpo-group-size 3", "--grpo-group-size is not supported yet: RL training"),
    ("--fp4-format e2m1", "--fp4-format is not supported yet"),
    ("--disable-use-tokenizer-model-from-checkpoint-args --inprocess-restart",
     "--inprocess-restart is not supported yet: in-process restart is not supported"),
    ("--rl-partial-rollouts", "--rl-partial-rollouts is not supported yet"),
    ("--mask-prob 0.2", "--mask-prob is not supported yet: only pretrain_bert.py and pretrain_t5.py read it"),
    ("--tokenizer-hf-no-use-fast", "--tokenizer-hf-no-use-fast is not supported yet: HuggingFaceTokenizer reads "
                                   "tokenizer.json with the fast tokenizers library"),
])
def test_not_supported_refused_in_one_line(argv, needle):
    with pytest.raises(ArgumentError) as e:
        _validate(argv.split())
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_not_supported_accepted_at_default():
    args = _validate("--grpo-group-size 2 --no-rl-partial-rollouts --mask-prob 0.15".split())
    assert args.grpo_group_size == 2 and args.rl_partial_rollouts is False


def test_no_effect_accepted_and_logged_once(capsys):
    args = _validate("--use-mcore-models --ckpt-fully-parallel-save".split())
    out = capsys.readouterr().out
    assert out.count("--use-mcore-models has no effect here (same result): ") == 1
    assert out.count("--ckpt-fully-parallel-save has no effect here") == 1
    assert not hasattr(args, mf._SEEN)  # nothing left on args for print_args or checkpoints


def test_aliases_set_our_dest():
    args = _validate("--no-barrier-with-level-1-timing --disable-log-loss-scale-to-tensorboard".split())
    assert args.barrier_with_L1_time is False and args.log_loss_scale_to_tensorboard is False
    assert PARSER.megatron_flags["--no-barrier-with-level-1-timing"][0] == mf.WORKS


def test_a_flag_defined_elsewhere_becomes_works():
    """A module that starts defining a Megatron flag needs no edit of the registry."""
    def add_cfg(parser):
        parser.add_argument("--fp4-format", type=str, default=None)
        return parser
    parser = build_parser(add_cfg)
    assert parser.megatron_flags["--fp4-format"] == (mf.WORKS, "")
    assert PARSER.megatron_flags["--fp4-format"][0] == mf.NOT_SUPPORTED
    assert _validate(["--fp4-format", "e2m1"], parser).fp4_format == "e2m1"


def test_bert_and_t5_flags():
    """Flags only BERT/T5/VLM/ViT classification define work there; OTHER_ENTRY_POINTS names exactly those."""
    from megatron.training.arguments.vision_args import add_vision_classify_args, add_vlm_args
    bert, t5 = build_parser(pretrain_bert.add_bert_args), build_parser(pretrain_t5.add_t5_args)
    vlm, vit = build_parser(add_vlm_args), build_parser(add_vision_classify_args)
    assert vlm.parse_args(BASE + ["--img-h", "336", "--freeze-ViT"]).img_h == 336
    assert vit.parse_args(BASE + ["--num-classes", "10", "--classes-fraction", "0.5"]).num_classes == 10
    only_there = {o for p in (bert, t5, vlm, vit) for o, (s, _) in p.megatron_flags.items()
                  if s == mf.WORKS and PARSER.megatron_flags[o][0] != mf.WORKS}
    assert only_there == set(mf.OTHER_ENTRY_POINTS)
    assert bert.parse_args(BASE + ["--mask-prob", "0.3", "--use-mcore-models"]).mask_prob == 0.3
    assert t5.parse_args(BASE + ["--decoder-seq-length", "16", "--perform-rl-step"]).decoder_seq_length == 16


def test_no_effect_entries_are_registry_flags():
    """Each NO_EFFECT entry is a Megatron flag that no module defines (else delete it from NO_EFFECT)."""
    stale = [o for o in mf.NO_EFFECT if PARSER.megatron_flags.get(o, ("",))[0] != mf.NO_EFFECT_HERE]
    assert not stale, f"delete from NO_EFFECT (defined by a module now, or not a Megatron flag): {stale}"


def test_migrating_doc_is_current():
    assert megatron_flags_docs.is_current(), (
        f"docs/migrating.md's flag table is out of date; run: {megatron_flags_docs.REGENERATE}")


def test_parse_args_entry(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse_args(argv=BASE + ["--use-mcore-models", "--dist-ckpt-strictness", "assume_ok_unexpected"])
    assert args.deprecated_use_mcore_models and args.dist_ckpt_strictness == "assume_ok_unexpected"
