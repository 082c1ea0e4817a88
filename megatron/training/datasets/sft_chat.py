"""Chat prompt formats for SFT: render a conversation to token ids and mark the assistant tokens.

A conversation is rendered once with a Jinja chat template (the HF tokenizer's own, `default`, or one of
Megatron's named `--sft-tokenizer-prompt-format`s) and tokenized with offsets. The characters each
assistant message adds are found by rendering the prefixes: an assistant turn spans from the end of
`render(messages[:i], add_generation_prompt=True)` to the end of `render(messages[:i + 1])`, so its content
and closing tokens (e.g. `<|eot_id|>`) are trained, its header and every system / user / tool token are not.
"""
import os
from typing import Dict, List, Optional, Tuple

import numpy

ROLES = ("system", "user", "assistant", "tool")

# Megatron's named formats (megatron/core/tokenizers/text/libraries/sft_tokenizer.py), as templates.
# `identity` concatenates the contents; the nemotron ones use Nemotron's <SPECIAL_n> tokens.
_NEMOTRON_H_ALIGNED = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<SPECIAL_10>System\n' + message['content'].strip() + '\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<SPECIAL_11>User\n' + message['content'].strip() + '\n' + '<SPECIAL_11>Assistant\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'].strip() + '\n' }}{% endif %}{% endfor %}")
_NEMOTRON_NANO_V2 = (
    "{% for message in messages %}{% set content = message['content'] %}{% if message['role'] == 'system' %}"
    "{{ '<SPECIAL_10>System\n' + content.replace('/think', '').replace('/no_think', '').strip() + '\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<SPECIAL_11>User\n' + content.replace('/think', '').replace('/no_think', '').strip() + '\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<SPECIAL_11>Assistant\n' + content.strip() + '\n<SPECIAL_12>\n' }}{% endif %}{% endfor %}")
_IDENTITY = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
PROMPT_FORMATS = {"default": None, "identity": _IDENTITY, "nemotron-h-aligned": _NEMOTRON_H_ALIGNED,
                  "nemotron-nano-v2": _NEMOTRON_NANO_V2}


def read_chat_template(value: Optional[str]) -> Optional[str]:
    """--chat-template: the Jinja template itself, or a file holding it (read here)."""
    if value and os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


class RecordError(ValueError):
    """One bad conversation: the message says what is wrong (the caller adds file and line)."""


def load_hf_tokenizer(path: str):
    """The Hugging Face tokenizer under `path` (local files only), for its chat template and offsets."""
    try:
        from transformers import AutoTokenizer  # lazy: ~2 s to import, SFT data only
    except ImportError as e:
        raise ImportError("--sft renders conversations with a Hugging Face tokenizer: pip install transformers") from e
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class ChatFormat:
    """Renders conversations with one prompt format of one HF tokenizer: `tokenize(messages)` -> (ids,
    assistant mask), both int arrays of the same length."""

    def __init__(self, hf_tokenizer, prompt_format: str = "default", tokenizer_path: str = "",
                 chat_template: Optional[str] = None):
        """``chat_template`` (--chat-template): a Jinja template that replaces the prompt format's and the
        tokenizer's own."""
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"--sft-tokenizer-prompt-format {prompt_format!r} is unknown; choose one of "
                             f"{', '.join(PROMPT_FORMATS)}")
        self.tokenizer = hf_tokenizer
        self.prompt_format = prompt_format
        if chat_template:
            self.prompt_format, self.template = "chat-template", chat_template
        else:
            self.template = PROMPT_FORMATS[prompt_format] or getattr(hf_tokenizer, "chat_template", None)
        if not self.template:
            named = ", ".join(f for f in PROMPT_FORMATS if f != "default")
            raise ValueError(f"--tokenizer-model {tokenizer_path}: the tokenizer has no chat template "
                             "(tokenizer_config.json 'chat_template' or chat_template.jinja); add one or pick "
                             f"--sft-tokenizer-prompt-format from {named}")
        if not getattr(hf_tokenizer, "is_fast", False):
            raise ValueError(f"--tokenizer-model {tokenizer_path}: SFT needs a fast tokenizer (tokenizer.json) "
                             "for token offsets")

    def _render(self, messages: List[Dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def tokenize(self, messages: List[Dict]) -> Tuple[numpy.ndarray, numpy.ndarray]:
        check_messages(messages)
        try:
            text = self._render(messages)
            spans = []
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                start = len(self._render(messages[:i], add_generation_prompt=True))
                end_text = self._render(messages[:i + 1])
                if not text.startswith(end_text):
                    raise RecordError(f"the chat template renders message {i} differently inside the whole "
                                      "conversation (not prefix-stable); the assistant span cannot be found")
                spans.append((start, len(end_text)))
        except RecordError:
            raise
        except Exception as e:  # a template's raise_exception (e.g. roles must alternate) or a Jinja error
            raise RecordError(f"chat template failed: {type(e).__name__}: {e}") from e
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = numpy.asarray(enc["input_ids"], dtype=numpy.int64)
        starts = numpy.asarray([o[0] for o in enc["offset_mapping"]], dtype=numpy.int64)
        mask = numpy.zeros(len(ids), dtype=numpy.int64)
        for beg, end in spans:
            mask[(starts >= beg) & (starts < end)] = 1
        if not mask.any():
            raise RecordError("the assistant turns render to no tokens")
        return ids, mask


def check_messages(messages) -> None:
    """Raise RecordError naming the first problem of one conversation's message list."""
    if not isinstance(messages, list) or not messages:
        raise RecordError("'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise RecordError(f"message {i} must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise RecordError(f"message {i} has unknown role {m['role']!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise RecordError(f"message {i} content must be a string")
        if m["role"] == "assistant" and not m["content"].strip():
            raise RecordError(f"message {i} is an empty assistant turn")
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no assistant turn (nothing to train on)")


def split_conversations(messages) -> List[List[Dict]]:
    """Megatron's convention: one JSONL line may hold several conversations, each opened by a system
    message after the first."""
    if not isinstance(messages, list):
        return [messages]
    out: List[List[Dict]] = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "system" and out and out[-1]:
            out.append([m])
        elif out:
            out[-1].append(m)
        else:
            out.append([m])
    return out or [messages]


def messages_of(record) -> Optional[list]:
    """The message list of one JSONL record: {"messages": [...]} (Megatron's and OpenAI's layout)."""
    if isinstance(record, dict) and "messages" in record:
        return record["messages"]
    raise RecordError("a record must be a JSON object with a 'messages' list")
