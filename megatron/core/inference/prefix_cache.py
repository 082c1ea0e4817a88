"""Prefix caching over the engine's KV-cache slots (Megatron's --inference-dynamic-batching-prefix-caching).

Megatron's dynamic engine pages its KV cache in blocks of --inference-dynamic-batching-block-size tokens and
hashes each full block of a prompt; a later request whose prompt starts with the same blocks points its block
table at them, sharing them without a copy. Here a request owns one slot of --inference-max-seq-length
positions and attention reads a slot's positions contiguously (no block table), so sharing means copying:
``PrefixCache`` remembers, per slot, the token ids whose keys and values the slot holds (kept after its request
finishes, until the slot is reused), finds the slot holding the longest prefix of a new prompt in whole
blocks, and the engine copies that prefix's keys and values into the new request's slot (or nothing, when the
request took that very slot) and prefills only the rest, on chunked prefill's path. The last prompt token is
always recomputed: its logits give the first generated token.

Eviction policies (which slots may give their prefix):
- ``ref_zero``: only slots of requests still running; a slot forgets its tokens when its request finishes, as
  Megatron frees a block once no running request references it;
- ``lru``: finished requests' slots too; a new request takes the free slot holding the longest prefix of its
  prompt, else the least recently used free slot (evicting what that slot held).

Recurrent layers (Mamba-2, Gated DeltaNet) keep a per-slot state of the whole sequence so far that a copy of
keys and values cannot restore; Megatron snapshots those states at block boundaries
(--inference-dynamic-batching-prefix-caching-mamba-gb), which is not built here, so such models are refused.
"""
import itertools
from typing import List, Optional, Sequence, Tuple

EVICTION_POLICIES = ("ref_zero", "lru")


def refuse_prefix_caching(model) -> None:
    """NotImplementedError (one line naming the flag) for models whose cached prefix a KV copy cannot restore."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet  # lazy: the SSM modules load with hybrid models
    from megatron.core.ssm.mamba_mixer import MambaMixer  # lazy: as above
    if hasattr(model, "expand_image_tokens"):
        raise NotImplementedError("--inference-dynamic-batching-prefix-caching with a vision-language model is not "
                                  "supported: the image tokens of different images share one token id; drop the flag")
    if any(isinstance(m, (GatedDeltaNet, MambaMixer)) for m in model.modules()):
        raise NotImplementedError("--inference-dynamic-batching-prefix-caching with Mamba-2 or Gated DeltaNet layers "
                                  "is not supported (their per-slot state cannot be copied from a cached prefix "
                                  "without Megatron's state snapshots); drop the flag")


class PrefixCache:
    """Which tokens each slot's keys and values belong to, and the prompt tokens reused / computed so far."""

    def __init__(self, num_slots: int, block_size: int = 256, eviction_policy: str = "ref_zero"):
        if block_size < 1:
            raise ValueError(f"--inference-dynamic-batching-block-size ({block_size}) must be >= 1")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"--inference-dynamic-batching-prefix-caching-eviction-policy {eviction_policy}: "
                             f"choose one of {', '.join(EVICTION_POLICIES)}")
        self.block_size, self.eviction_policy = block_size, eviction_policy
        self.tokens: List[Optional[List[int]]] = [None] * num_slots  # token ids at positions [0, len) of the slot
        self.last_used = [0] * num_slots
        self._clock = itertools.count(1)
        self.reused_tokens = 0  # prompt tokens whose keys and values came from the cache
        self.computed_tokens = 0  # prompt tokens prefilled

    def common_blocks(self, a: Sequence[int], b: Sequence[int]) -> int:
        """Length of the common prefix of ``a`` and ``b`` in whole blocks (a multiple of block_size)."""
        bs, m, n = self.block_size, 0, min(len(a), len(b))
        while m + bs <= n and list(a[m:m + bs]) == list(b[m:m + bs]):
            m += bs
        return m

    def choose_slot(self, prompt: Sequence[int], free: List[int]) -> int:
        """The free slot a new request takes. lru: the one holding the longest prefix of ``prompt``, ties (no
        match included) to the least recently used; ref_zero: the first (free slots hold nothing)."""
        if self.eviction_policy != "lru":
            return free[0]
        return max(free, key=lambda s: (self.common_blocks(self.tokens[s] or (), prompt), -self.last_used[s]))

    def match(self, prompt: Sequence[int], own_slot: int) -> Tuple[Optional[int], int]:
        """(slot, length): the slot holding the longest whole-block prefix of ``prompt`` and how many of its
        tokens to reuse, at most len(prompt) - 1 (the last token is recomputed for its logits); the request's
        own slot wins ties (no copy). (None, 0) when nothing matches."""
        best, length = None, 0
        for slot, held in enumerate(self.tokens):
            m = 0 if held is None else self.common_blocks(held, prompt)
            if m > length or (m == length and m and slot == own_slot):
                best, length = slot, m
        length = min(length, len(prompt) - 1)
        return (best, length) if best is not None and length > 0 else (None, 0)

    def reuse(self, prompt: Sequence[int], own_slot: int) -> Tuple[Optional[int], int]:
        """``match``, counted: the request prefills from the returned length on."""
        slot, length = self.match(prompt, own_slot)
        if slot is not None:
            self.last_used[slot] = next(self._clock)
        self.reused_tokens += length
        self.computed_tokens += len(prompt) - length
        return slot, length

    def hold(self, slot: int, tokens: Sequence[int]) -> None:
        """The slot's keys and values at positions [0, len(tokens)) now belong to ``tokens`` (a prefill)."""
        self.tokens[slot] = list(tokens)
        self.last_used[slot] = next(self._clock)

    def release(self, slot: int, tokens: Sequence[int]) -> None:
        """The slot's request finished holding ``tokens`` (its prompt and every generated token fed back): lru
        keeps them for later requests, ref_zero forgets them."""
        self.tokens[slot] = list(tokens) if self.eviction_policy == "lru" else None
        self.last_used[slot] = next(self._clock)

    def clear(self) -> None:
        """Forget every slot (after a failed step the cache contents are unknown)."""
        self.tokens = [None] * len(self.tokens)
