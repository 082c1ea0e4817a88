"""--inference-logging-step-interval N: every N engine steps one line with the step count, the requests decoding and
waiting, and the prompt and generated tokens since the last line with their rate (Megatron's dynamic engine logs
its steps at this interval); with prefix caching also the prompt tokens taken from the cache instead of prefilled.
Printed by the first rank only; N = 0 logs nothing."""
import time
from typing import Callable, Optional

import torch


class StepLog:
    def __init__(self, interval: int, emit: Optional[Callable[[str], None]] = None, show_reused: bool = False):
        if interval < 0:
            raise ValueError(f"--inference-logging-step-interval ({interval}) must be >= 0")
        self.interval = interval
        self.show_reused = show_reused  # prefix caching: the line also says how many prompt tokens were reused
        self.emit = emit or _print_first_rank
        self.steps = 0
        self._prompt = self._generated = self._reused = 0
        self._since = time.perf_counter()

    def step(self, active: int, waiting: int, prompt_tokens: int, generated_tokens: int,
             reused_tokens: int = 0) -> None:
        """Count one engine step (``prompt_tokens`` admitted, ``reused_tokens`` of them taken from the prefix cache
        instead of prefilled, and ``generated_tokens`` decoded in it); the engine calls it only when logging
        (interval > 0)."""
        self.steps += 1
        self._prompt += prompt_tokens
        self._generated += generated_tokens
        self._reused += reused_tokens
        if self.steps % self.interval:
            return
        now = time.perf_counter()
        seconds = max(now - self._since, 1e-9)
        self.emit(f"inference step {self.steps} | active requests {active} | waiting {waiting} | "
                  f"prompt tokens {self._prompt} | "
                  + (f"reused prompt tokens {self._reused} | " if self.show_reused else "")
                  + f"generated tokens {self._generated} | "
                  f"{self._generated / seconds:.1f} generated tokens/s over {seconds:.2f} s")
        self._prompt = self._generated = self._reused = 0
        self._since = now


def _print_first_rank(line: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)
