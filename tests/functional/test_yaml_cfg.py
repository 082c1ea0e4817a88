"""`pretrain_gpt.py --yaml-cfg` through the real CLI: a Megatron-layout YAML trains, its values (and a
${VAR} from the environment) reach the arguments, and a no-effect flag on the command line is logged once."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

YAML = """\
# Megatron's layout: TransformerConfig fields, ModelParallelConfig fields, then argument names.
language_model:
  num_layers: 2
  hidden_size: 32
  num_attention_heads: 4
  hidden_dropout: 0.0
  attention_dropout: 0.0
  activation_func: swiglu
  layernorm_epsilon: 1.e-6
model_parallel:
  tensor_model_parallel_size: 1
  bf16: False
micro_batch_size: 2
global_batch_size: 4
seq_length: ${YAML_TEST_SEQ}
max_position_embeddings: 32
train_iters: 2
lr: 1.e-3
mock_data: True
tokenizer_type: NullTokenizer
vocab_size: 128
log_interval: 1
eval_iters: 0
num_workers: 0
"""


def test_pretrain_gpt_with_yaml_cfg(tmp_path):
    path = tmp_path / "gpt.yaml"
    path.write_text(YAML)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "YAML_TEST_SEQ": "32"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--yaml-cfg", str(path),
                        "--use-mcore-models"], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert " iteration        2/       2 |" in out, out[-2000:]
    for name, value in (("seq_length", "32"), ("hidden_size", "32"), ("swiglu", "True"), ("norm_epsilon", "1e-06"),
                        ("yaml_cfg", str(path))):
        assert f"  {name} {'.' * (48 - len(name))} {value}\n" in out, name
    assert out.count("--use-mcore-models has no effect here (same result)") == 1
