"""The serving loop: one thread owns the engine; HTTP threads submit prompts and wait.

Between two decode steps the loop takes every queued prompt into the engine, so a request arriving
while others decode joins their batch at the next step instead of waiting for them to finish.
With several ranks (TP), rank 0 runs this loop and broadcasts each step's new prompts; the other
ranks run ``follow`` and replay the same admissions and steps, so their collectives pair up.
"""
import queue
import random
import threading
import traceback
from dataclasses import replace
from typing import List, Optional

import torch

from megatron.core.inference import InferenceEngine, InferenceRequest, SamplingParams

HEARTBEAT_S = 30.0  # an idle rank 0 still broadcasts this often, so followers never hit the collective timeout
_STOP = -1


class Ticket:
    """One prompt of an HTTP request: what to run (``images``: its PromptImages or None), and where the
    loop leaves the result."""

    def __init__(self, prompt_tokens: List[int], params: SamplingParams, images=None):
        self.prompt_tokens, self.params, self.images = prompt_tokens, params, images
        self.done = threading.Event()
        self.request: Optional[InferenceRequest] = None
        self.error: Optional[str] = None


def _distributed() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _control_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" \
        else torch.device("cpu")


def _broadcast(items):
    """Rank 0: send ``items`` (a list, or None = stop); others: receive them."""
    n = torch.tensor([_STOP if items is None else len(items or [])], dtype=torch.long, device=_control_device())
    torch.distributed.broadcast(n, src=0)
    count = int(n.item())
    if count <= 0:
        return None if count == _STOP else []
    box = [items]
    torch.distributed.broadcast_object_list(box, src=0, device=_control_device())
    return box[0]


def _image_args(images):
    """(tiles, num_image_tiles) of a prompt's PromptImages, () without images."""
    return () if images is None else (images.tiles, images.num_image_tiles)


class GenerationScheduler:
    def __init__(self, engine: InferenceEngine):
        self.engine = engine
        self.queue: "queue.Queue[Optional[Ticket]]" = queue.Queue()
        self._stopping = threading.Event()

    def submit(self, prompt_tokens: List[int], params: SamplingParams, images=None) -> Ticket:
        """Validate (ValueError with the reason) and queue one prompt (``images``: its PromptImages);
        thread-safe."""
        self.engine.prepare_prompt(prompt_tokens, params, *_image_args(images))
        if params.random_seed is None:  # every rank must draw the same numbers for this request
            params = replace(params, random_seed=random.SystemRandom().getrandbits(62))
        ticket = Ticket(list(prompt_tokens), params, images)
        self.queue.put(ticket)
        return ticket

    def stop(self) -> None:
        self._stopping.set()
        self.queue.put(None)

    def _drain(self, block: bool) -> List[Ticket]:
        items = []
        try:
            items.append(self.queue.get(timeout=HEARTBEAT_S) if block else self.queue.get_nowait())
            while True:
                items.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        return [t for t in items if t is not None]

    def run(self) -> None:
        """The loop (rank 0, main thread) until ``stop()``."""
        while not self._stopping.is_set():
            tickets = self._drain(block=not self.engine.has_work())
            if self._stopping.is_set():
                break
            if _distributed():
                _broadcast([(t.prompt_tokens, t.params, t.images) for t in tickets])
            for t in tickets:
                t.request = self.engine.add_request(t.prompt_tokens, t.params, t.done, *_image_args(t.images))
            if self.engine.has_work():
                self._step()
        if _distributed():
            _broadcast(None)
        for t in self._drain(block=False):
            t.error = "the server is shutting down"
            t.done.set()

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as e:  # fail the requests in flight, keep serving
            traceback.print_exc()
            self.engine.abort_all(f"error: {type(e).__name__}: {e}")
            if _distributed():
                raise  # the other ranks cannot be brought back in step


def follow(engine: InferenceEngine) -> None:
    """Ranks other than 0: replay rank 0's admissions and steps until it stops."""
    while True:
        items = _broadcast([])  # receives rank 0's list (or its stop)
        if items is None:
            return
        for prompt_tokens, params, images in items:
            engine.add_request(prompt_tokens, params, None, *_image_args(images))
        if engine.has_work():
            engine.step()
