"""One prompt's generation state, from submission to its finished text (Megatron's ``InferenceRequest``)."""
import random
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

import torch

from megatron.core.inference.sampling_params import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    ACTIVE = "active"
    COMPLETED = "completed"


@dataclass
class InferenceRequest:
    request_id: int
    prompt_tokens: List[int]
    sampling_params: SamplingParams
    generated_tokens: List[int] = field(default_factory=list)
    generated_log_probs: List[float] = field(default_factory=list)
    prompt_log_probs: List[float] = field(default_factory=list)  # of prompt tokens 1..n-1
    generated_text: Optional[str] = None  # set at finish when the engine has a detokenizer
    finish_reason: Optional[str] = None  # "stop" (EOD / stop word) or "length"
    status: Status = Status.WAITING
    slot: Optional[int] = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    # A vision-language model's request: its image tiles [tiles, c, H, W] (released after prefill), and the
    # prompt as given (one image token per image; ``prompt_tokens`` then holds the decoder's expanded sequence).
    images: Optional[torch.Tensor] = field(default=None, repr=False)
    input_prompt_tokens: Optional[List[int]] = None
    num_image_tiles: Optional[List[int]] = None  # tiles of each image, in prompt order

    def __post_init__(self):
        seed = self.sampling_params.random_seed
        # Unseeded requests still get their own stream, so they never perturb seeded ones.
        self.rng = random.Random(seed if seed is not None else random.SystemRandom().getrandbits(63))

    @property
    def given_prompt_tokens(self) -> List[int]:
        """The prompt as the caller sent it (image tokens not expanded)."""
        return self.prompt_tokens if self.input_prompt_tokens is None else self.input_prompt_tokens

    @property
    def length(self) -> int:
        """Tokens in the sequence so far (prompt + generated)."""
        return len(self.prompt_tokens) + len(self.generated_tokens)
