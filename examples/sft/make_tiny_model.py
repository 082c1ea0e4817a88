"""Write a tiny random Hugging Face Llama with a chat-template tokenizer, and a JSONL file of conversations,
for examples/sft/sft_tiny_cpu.sh:  python examples/sft/make_tiny_model.py --output DIR  (DIR/hf, DIR/chats.jsonl)."""
import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir)))

import torch  # noqa: E402

from tests.fixtures.tiny_chat_tokenizer import write_tiny_chat_tokenizer  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--conversations", type=int, default=200)
    args = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM  # transformers: only to write the HF model
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=256, eos_token_id=259)
    hf_dir = os.path.join(args.output, "hf")
    LlamaForCausalLM(cfg).save_pretrained(hf_dir)
    write_tiny_chat_tokenizer(hf_dir)
    rng = random.Random(0)
    with open(os.path.join(args.output, "chats.jsonl"), "w") as f:
        for i in range(args.conversations):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            messages = [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]
            if i % 4 == 0:  # some multi-turn conversations with a system prompt
                messages = [{"role": "system", "content": "Answer with a number."}, *messages,
                            {"role": "user", "content": "Double it?"},
                            {"role": "assistant", "content": f"{2 * (a + b)}"}]
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {hf_dir} and {os.path.join(args.output, 'chats.jsonl')}")


if __name__ == "__main__":
    main()
