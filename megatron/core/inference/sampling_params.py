"""Per-request generation settings: Megatron's ``SamplingParams`` fields and defaults.

``num_tokens_to_generate`` None means "up to the engine's max sequence length" (or ``num_tokens_total``
minus the prompt); ``termination_id`` None means the engine's end-of-document id. Fields for outputs the
engine here does not produce (per-token segments, top-n log-probs, kept stop sequences, skipped prompt
log-probs) are accepted at their defaults and refused otherwise by `validate`; prompt tokens are always
kept on the request, so ``return_prompt_tokens`` changes nothing. ``random_seed`` (ours) makes a sampled
request reproducible whatever else is in the batch.
"""
from dataclasses import dataclass
from typing import List, Optional


@dataclass
class SamplingParams:
    """temperature 0 or top_k 1 is greedy; top_k 0 and top_p 0 disable those filters (Megatron's convention)."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    return_log_probs: bool = False
    skip_prompt_log_probs: bool = False
    return_segments: bool = False
    num_tokens_to_generate: Optional[int] = None
    num_tokens_total: Optional[int] = None
    termination_id: Optional[int] = None
    top_n_logprobs: int = 0
    return_prompt_top_n_logprobs: bool = False
    add_BOS: bool = False
    stop_words: Optional[List[str]] = None
    detokenize_stop_sequence: bool = False
    return_prompt_tokens: bool = False
    random_seed: Optional[int] = None

    def __post_init__(self):
        # Megatron derives this deprecated field from the two that replace it.
        self.return_prompt_top_n_logprobs = self.top_n_logprobs > 0 and not self.skip_prompt_log_probs

    @property
    def greedy(self) -> bool:
        return self.top_k == 1 or self.temperature == 0.0

    def add_attributes(self, attribute_value_pair: dict):
        """Set extra attributes (Megatron's hook for custom sampling settings)."""
        for key, value in attribute_value_pair.items():
            setattr(self, key, value)

    def tokens_to_generate(self, num_prompt_tokens: int, max_sequence_length: int) -> int:
        """The number of tokens this request generates, for a prompt of ``num_prompt_tokens``."""
        if self.num_tokens_total is not None:
            return self.num_tokens_total - num_prompt_tokens
        if self.num_tokens_to_generate is None:
            return max_sequence_length - num_prompt_tokens
        return self.num_tokens_to_generate

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        m = self.num_tokens_to_generate
        if m is not None and (not isinstance(m, int) or m < 0):
            raise ValueError("tokens_to_generate must be an integer >= 0")
        if m is not None and self.num_tokens_total is not None:
            raise ValueError("set num_tokens_to_generate or num_tokens_total, not both")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError("temperature must be between 0 and 100")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError("top_k must be an integer >= 0")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError("top_p must be between 0 and 1")
        if self.top_k > 1 and self.top_p > 0.0:
            raise ValueError("cannot set both top_k and top_p")
        if self.random_seed is not None and (not isinstance(self.random_seed, int) or self.random_seed < 0):
            raise ValueError("random_seed must be an integer >= 0")
        for name in ("skip_prompt_log_probs", "return_segments", "top_n_logprobs", "detokenize_stop_sequence"):
            if getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by this engine; leave it at "
                                 "its default")
