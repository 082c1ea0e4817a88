"""--sft data: assistant-only loss, packing equal to one-by-one, bad records named by file and line, and a
sample order that depends only on the seed (so resuming from consumed samples replays the same order)."""
import json
import os
import runpy
import types

import numpy
import pytest
import torch

pytest.importorskip("transformers")

from megatron.core.datasets.utils import Split  # noqa: E402
from megatron.training.datasets.data_samplers import MegatronPretrainingSampler  # noqa: E402
from megatron.training.datasets.sft_chat import ChatFormat, load_hf_tokenizer, split_conversations  # noqa: E402
from megatron.training.datasets.sft_conversations import (  # noqa: E402
    BadRecordError,
    load_conversations,
    tokenize_jsonl,
)
from megatron.training.datasets.sft_dataset import SFTDataset, SFTDatasetConfig  # noqa: E402
from tests.fixtures.tiny_chat_tokenizer import write_tiny_chat_tokenizer  # noqa: E402
from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
SEQ, VOCAB = 192, 260


def _conversation(i):
    return {"messages": [{"role": "system", "content": "Be brief."} if i % 3 == 0 else
                         {"role": "user", "content": "Warm up."},
                         {"role": "user", "content": f"Say {i} {'x' * (i % 7)}"},
                         {"role": "assistant", "content": f"{i} {'y' * (i % 5)}"}]}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    tok_dir = write_tiny_chat_tokenizer(str(root / "tok"))
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(_conversation(i)) + "\n" for i in range(24)))
    hf = load_hf_tokenizer(tok_dir)
    return types.SimpleNamespace(root=root, tok_dir=tok_dir, data=str(data), hf=hf, chat=ChatFormat(hf, "default"))


def _config(env, seed=1234, seq=SEQ, bad="stop"):
    tok = types.SimpleNamespace(eod=259, pad=259, unique_identifiers={"class": "tiny"})
    return SFTDatasetConfig(random_seed=seed, sequence_length=seq, blend=None, split="100,0,0", tokenizer=tok,
                            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                            create_attention_mask=False, sft_tokenizer_path=env.tok_dir,
                            sft_prompt_format="default", sft_bad_records=bad)


def _dataset(env, num_samples=None, seed=1234, path=None):
    config = _config(env, seed)
    low = SFTDataset.build_low_level_dataset(path or env.data, config)
    return SFTDataset(low, path or env.data, numpy.arange(len(low), dtype=numpy.int32), num_samples, Split.train,
                      config)


def test_only_assistant_tokens_are_trained(env):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
                {"role": "assistant", "content": "A2"}]
    ids, mask = env.chat.tokenize(messages)
    assert env.hf.decode(ids[mask == 1].tolist()) == "A1<|eot_id|>A2<|eot_id|>"
    assert ids.tolist() == env.hf.apply_chat_template(messages, tokenize=True, return_dict=False)
    # Megatron's named formats render the same roles; identity trains the assistant contents only
    ids, mask = ChatFormat(env.hf, "identity").tokenize(messages)
    assert env.hf.decode(ids[mask == 1].tolist()) == "A1A2"


def test_megatron_lines_holding_several_conversations_are_split_at_system_messages():
    line = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
            {"role": "assistant", "content": "c"}, {"role": "system", "content": "d"},
            {"role": "user", "content": "e"}, {"role": "assistant", "content": "f"}]
    assert [[m["content"] for m in c] for c in split_conversations(line)] == [["a", "b", "c"], ["d", "e", "f"]]


def test_packed_sample_layout(env):
    ds = _dataset(env)
    data = ds.dataset
    assert len(ds) < len(data)  # several conversations per sample
    for idx in range(len(ds)):
        sample = ds[idx]
        docs = ds.order[ds.sample_starts[idx]:ds.sample_starts[idx + 1]]
        at = 0
        for k in docs:
            ids, mask = data.get(int(k))
            n = len(ids) - 1
            assert sample["tokens"][at:at + n].tolist() == ids[:-1].tolist()
            assert sample["labels"][at:at + n].tolist() == ids[1:].tolist()
            assert sample["loss_mask"][at:at + n].tolist() == mask[1:].tolist()
            assert sample["position_ids"][at:at + n].tolist() == list(range(n))
            at += n
        assert not sample["loss_mask"][at:].any()
        cu = sample["cu_seqlens"]
        assert cu.shape == (SEQ + 1,) and cu[0] == 0 and cu[-1] == SEQ
        starts = numpy.cumsum([0] + [len(data.get(int(k))[0]) - 1 for k in docs])
        assert sorted(set(cu.tolist())) == sorted(set(starts.tolist()) | {SEQ})


def _model():
    torch.manual_seed(0)
    return tiny_gpt(tiny_config(), vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def _packed_params(cu, seq):
    import pretrain_gpt
    return pretrain_gpt._packed_seq_params(cu[None], seq)


def test_packed_losses_equal_each_conversation_alone(env):
    """fp32: per-token losses of a packed sample equal the same conversations run one by one (1e-5).
    The only difference is the attention's summation over masked keys, measured ~1e-7."""
    ds, model = _dataset(env), _model()
    sample = ds[0]
    docs = ds.order[ds.sample_starts[0]:ds.sample_starts[1]]
    assert len(docs) >= 2
    with torch.no_grad():
        packed = model(sample["tokens"][None], sample["position_ids"][None], None, labels=sample["labels"][None],
                       packed_seq_params=_packed_params(sample["cu_seqlens"], SEQ))[0]
        at = 0
        for k in docs:
            ids = torch.as_tensor(ds.dataset.get(int(k))[0], dtype=torch.long)
            n = len(ids) - 1
            alone = model(ids[None, :-1], torch.arange(n)[None], None, labels=ids[None, 1:])[0]
            torch.testing.assert_close(packed[at:at + n], alone, rtol=1e-5, atol=1e-5)
            at += n


def test_masked_labels_never_contribute(env):
    """Changing the label of any token outside an assistant span leaves loss and gradients unchanged."""
    ds, model = _dataset(env), _model()
    sample = ds[0]
    params = _packed_params(sample["cu_seqlens"], SEQ)

    def loss_and_grads(labels):
        model.zero_grad()
        per_token = model(sample["tokens"][None], sample["position_ids"][None], None, labels=labels[None],
                          packed_seq_params=params)
        loss = (per_token[0] * sample["loss_mask"]).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads(sample["labels"])
    masked = (sample["loss_mask"] == 0).nonzero().flatten()
    assert len(masked) > 10
    perturbed = sample["labels"].clone()
    perturbed[masked] = (perturbed[masked] + 17) % VOCAB
    loss2, grads2 = loss_and_grads(perturbed)
    assert torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    trained = (sample["loss_mask"] == 1).nonzero().flatten()[0]  # the check can fail: a trained label counts
    perturbed[trained] = (perturbed[trained] + 17) % VOCAB
    assert not torch.equal(loss_and_grads(perturbed)[0], loss)


def test_order_depends_only_on_seed_and_resumes_from_consumed_samples(env):
    a, b = _dataset(env, num_samples=40), _dataset(env, num_samples=40)
    assert len(a) >= 40 and numpy.array_equal(a.order, b.order)  # several epochs, rebuilt identically
    assert not numpy.array_equal(_dataset(env, num_samples=40, seed=7).order, a.order)
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))

    def batches(consumed):
        sampler = MegatronPretrainingSampler(total_samples=len(a), consumed_samples=consumed, micro_batch_size=2,
                                             data_parallel_rank=0, data_parallel_size=1)
        return [[a[i]["tokens"] for i in idx] for idx in sampler]

    full, resumed = batches(0), batches(12)  # stopped after 12 samples, restarted from the checkpoint's count
    assert len(resumed) == len(full) - 6
    assert all(torch.equal(x, y) for fb, rb in zip(full[6:], resumed) for x, y in zip(fb, rb))


BAD = [
    ("not json", "not valid JSON"),
    (json.dumps({"text": "hi"}), "a record must be a JSON object with a 'messages' list"),
    (json.dumps({"messages": [{"role": "user", "content": "q"}]}), "no assistant turn"),
    (json.dumps({"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]}),
     "unknown role 'robot'"),
    (json.dumps({"messages": [{"role": "user", "content": "q" * 300}, {"role": "assistant", "content": "a"}]}),
     "is longer than --seq-length 192"),
]


def _bad_file(env, name):
    good = [json.dumps(_conversation(i)) for i in range(3)]
    lines = [good[0], BAD[0][0], good[1], *[b for b, _ in BAD[1:]], good[2]]
    path = env.root / name
    path.write_text("\n".join(lines) + "\n")
    return str(path), {2: BAD[0][1], 4: BAD[1][1], 5: BAD[2][1], 6: BAD[3][1], 7: BAD[4][1]}


def test_bad_records_are_named_by_file_and_line(env):
    path, expected = _bad_file(env, "bad.jsonl")
    with pytest.raises(BadRecordError) as e:
        tokenize_jsonl(path, env.chat, SEQ, "stop")
    assert str(e.value).startswith(f"{path}:2: not valid JSON") and "\n" not in str(e.value)
    reported = []
    data = tokenize_jsonl(path, env.chat, SEQ, "skip", report=reported.append)
    assert len(data) == 3 and data.lines.tolist() == [1, 3, 8]
    assert len(reported) == len(expected)
    for line, (lineno, what) in zip(reported, sorted(expected.items())):
        assert line.startswith(f"{path}:{lineno}: ") and what in line and line.endswith("(skipped)"), line


def test_missing_chat_template_is_one_line(env):
    bare = load_hf_tokenizer(write_tiny_chat_tokenizer(str(env.root / "bare"), chat_template=None))
    with pytest.raises(ValueError, match=r"the tokenizer has no chat template .* --sft-tokenizer-prompt-format"):
        ChatFormat(bare, "default", "bare")
    assert ChatFormat(bare, "identity").tokenize(_conversation(1)["messages"])[1].any()


def test_prepare_tool_writes_atomically_and_training_reads_it(env, capsys):
    main = runpy.run_path(os.path.join(ROOT, "tools", "prepare_sft_data.py"))["main"]
    path, expected = _bad_file(env, "bad2.jsonl")
    out = str(env.root / "prepared.npz")
    argv = ["--input", path, "--output", out, "--tokenizer-model", env.tok_dir, "--seq-length", str(SEQ)]
    assert main(argv) == 1 and not os.path.exists(out)  # stop: nothing written, no temporary left
    assert os.listdir(env.root / "tok") and not [f for f in os.listdir(env.root) if f.endswith(".tmp")]
    err = capsys.readouterr().err
    assert f"{path}:2: not valid JSON" in err
    assert main(argv + ["--sft-bad-records", "skip"]) == 0 and os.path.isfile(out)
    err = capsys.readouterr().err
    assert all(f"{path}:{n}: " in err for n in expected)
    from_npz = load_conversations(out, env.chat, SEQ)
    from_jsonl = tokenize_jsonl(path, env.chat, SEQ, "skip", report=lambda _: None)
    assert numpy.array_equal(from_npz.tokens, from_jsonl.tokens) and numpy.array_equal(from_npz.mask, from_jsonl.mask)
    with pytest.raises(BadRecordError, match=r"bad2.jsonl:\d+: conversation of \d+ tokens is longer than "
                                             r"--seq-length 40"):
        load_conversations(out, env.chat, 40)  # a shorter --seq-length at training time
    with pytest.raises(ValueError, match="another chat template"):
        load_conversations(out, ChatFormat(env.hf, "identity"), SEQ)


def test_chat_template_flag_replaces_the_prompt_format(env, tmp_path):
    """--chat-template (the template, or a file holding it) renders the conversations instead of the prompt format;
    the dataset's cache identity and a prepared file's template follow it."""
    from megatron.training.datasets.sft_chat import read_chat_template
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == template and read_chat_template(template) == template
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    chat = ChatFormat(env.hf, "nemotron-h-aligned", env.tok_dir, chat_template=template)
    ids, mask = chat.tokenize(messages)
    assert env.hf.decode(ids.tolist()) == "[user]Q[assistant]A" and env.hf.decode(ids[mask == 1].tolist()) == "A"
    assert chat.template == template and chat.prompt_format == "chat-template"
    assert "sft_chat_template" in SFTDataset._key_config_attributes()
