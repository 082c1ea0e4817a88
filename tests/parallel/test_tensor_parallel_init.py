"""Layout-independent init + sharded_state_dict: TP=4, TP=2 and TP=2 x PP=2 shards, reassembled from
their ShardedTensors, equal the TP=1 model's weights exactly (same generator, same global tensor)."""
import os

import torch
import torch.nn.functional as F

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt
from tests.parallel.dist_utils import run_distributed

VOCAB, SEQ = 64, 8


def _model(arch, tp=1, pp=1, pre=True, post=True):
    common = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, use_cpu_initialization=True)
    if arch == "gpt2":
        cfg = tiny_config(hidden_size=16, num_attention_heads=4, **common)
        return tiny_gpt(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=pre, post_process=post)
    cfg = tiny_config(hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=48,
                      normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                      add_bias_linear=False, qk_layernorm=True, **common)
    return tiny_gpt(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, spec=get_gpt_layer_local_spec(qk_layernorm=True),
                    pre_process=pre, post_process=post, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def _shards(layouts):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo CPU test, also on GPU hosts with fewer GPUs than ranks
    from megatron.core import parallel_state as ps

    out = []
    for tp, pp in layouts:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        per_arch = {}
        for arch in ("gpt2", "llama"):
            model = _model(arch, tp, pp, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
            sd = model.sharded_state_dict()
            per_arch[arch] = {k: (st.key, st.global_shape, st.global_offset, st.replica_id, st.data.clone())
                              for k, st in sd.items()}
        out.append(per_arch)
    return out


def _assemble(rank_dicts):
    """Global tensors from the main replicas; every element must be written exactly once."""
    full, count = {}, {}
    for sd in rank_dicts:
        for key, shape, offset, replica, data in sd.values():
            if any(replica):
                continue
            full.setdefault(key, torch.zeros(shape))
            count.setdefault(key, torch.zeros(shape))
            idx = tuple(slice(o, o + n) for o, n in zip(offset, data.shape))
            full[key][idx] = data
            count[key][idx] += 1
    for key, c in count.items():
        assert bool((c == 1).all()), f"{key}: shards overlap or leave holes"
    return full


def test_init_and_shards_match_tp1():
    reference = {arch: _model(arch).state_dict() for arch in ("gpt2", "llama")}
    res = run_distributed(_shards, 4, [(4, 1), (2, 1), (2, 2)])
    for layout in range(3):
        for arch, ref in reference.items():
            full = _assemble([r[layout][arch] for r in res])
            assert set(full) == set(ref), (layout, arch)
            for key, tensor in full.items():
                torch.testing.assert_close(tensor.reshape(ref[key].shape), ref[key], rtol=0, atol=0)
    # PP=2: layer 1 lives on stage 1 under its global name; the tied output weight there is a replica.
    rank2 = res[2][2]["gpt2"]
    assert rank2["decoder.layers.0.mlp.linear_fc1.weight"][0] == "decoder.layers.1.mlp.linear_fc1.weight"
    assert rank2["output_layer.weight"][0] == "embedding.word_embeddings.weight"
    assert rank2["output_layer.weight"][3][1] == 1
    assert torch.equal(rank2["output_layer.weight"][4], res[0][2]["gpt2"]["embedding.word_embeddings.weight"][4])
    # SwiGLU fc1 is exposed as [2, f, h] so each TP slice is [gate_r; up_r].
    assert res[0][0]["llama"]["decoder.layers.0.mlp.linear_fc1.weight"][1] == (2, 48, 32)
