"""Per-request generation settings (Megatron's ``SamplingParams`` names)."""
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class SamplingParams:
    """temperature 0 or top_k 1 is greedy; top_k 0 and top_p 0 disable those filters (Megatron's
    convention). ``random_seed`` makes a sampled request reproducible whatever else is in the batch."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    num_tokens_to_generate: int = 30
    return_log_probs: bool = False
    random_seed: Optional[int] = None
    stop_words: List[str] = field(default_factory=list)
    add_BOS: bool = False

    @property
    def greedy(self) -> bool:
        return self.top_k == 1 or self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.num_tokens_to_generate, int) or self.num_tokens_to_generate < 0:
            raise ValueError("tokens_to_generate must be an integer >= 0")
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
