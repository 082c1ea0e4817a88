"""--inference-logging-step-interval N: every N engine steps one line with the step count, the requests decoding and
waiting, and the prompt and generated tokens since the last line with their rate (Megatron's dynamic engine logs
its steps at this interval). Printed by the first rank only; N = 0 logs nothing."""
import time
from typing import Callable, Optional

import torch


class StepLog:
    def __init__(self, interval: int, emit: Optional[Callable[[str], None]] = None):
        if interval < 0:
            raise ValueError(f"--inference-logging-step-interval ({interval}) must be >= 0")
        self.interval = interval
        self.emit = emit or _print_first_rank
        self.steps = 0
        self._prompt = self._generated = 0
        self._since = time.perf_counter()

    def step(self, active: int, waiting: int, prompt_tokens: int, generated_tokens: int) -> None:
        """Count one engine step (``prompt_tokens`` prefilled and ``generated_tokens`` decoded in it); the engine
        calls it only when logging (interval > 0)."""
        self.steps += 1
        self._prompt += prompt_tokens
        self._generated += generated_tokens
        if self.steps % self.interval:
            return
        now = time.perf_counter()
        seconds = max(now - self._since, 1e-9)
        self.emit(f"inference step {self.steps} | active requests {active} | waiting {waiting} | "
                  f"prompt tokens {self._prompt} | generated tokens {self._generated} | "
                  f"{self._generated / seconds:.1f} generated tokens/s over {seconds:.2f} s")
        self._prompt = self._generated = 0
        self._since = now


def _print_first_rank(line: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)
