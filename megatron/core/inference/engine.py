"""InferenceEngine: continuous batching of generation requests over one GPTModel (or a LLaVAModel).

Each ``step()`` admits waiting requests into free KV-cache slots (one batched prefill, which also
samples their first token), then runs one decode step for every active slot. Requests of any length
join and leave between steps. On every TP rank the engine runs the same steps on the same requests
(the server broadcasts them), so TP collectives inside the model pair up and all ranks agree on tokens:
full logits are all-gathered and sampling is deterministic given the per-request uniforms.

Decode state lives in device buffers indexed by slot (last token, position, sampling parameters) and
a step updates them in place (next token, position + 1), so on CUDA the whole step, sampling included,
is one replayed graph and the host reads back only the sampled tokens.

A vision-language model (LLaVAModel) takes images with a prompt: the prompt holds one image token per
image, which the request expands to the image's feature positions; its prefill runs the vision encoder
and projector and puts their features at those positions; decode is the text model's, as above.

With prefix caching (``prefix_cache.py``) a prompt that starts with whole blocks of tokens another slot holds
gets their keys and values copied into its slot and prefills only the rest.
"""
import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

import torch

from megatron.core import parallel_state
from megatron.core.fusions.compile import _raise_recompile_limit
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.cuda_graphs import DecodeGraphs, batch_ladder, bucket, ladder_bucket
from megatron.core.inference.inference_request import InferenceRequest, Status
from megatron.core.inference.prefix_cache import PrefixCache, refuse_prefix_caching
from megatron.core.inference.sampling import sample_tokens, token_log_probs
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.step_log import StepLog
from megatron.core.utils import unwrap_model


def _compiled(step_fn, backend: str = "inductor"):
    """torch.compile(step_fn) with dynamic batch / KV length (one compile serves every graph bucket but
    batch 1, which torch specializes); on a compile error, a warning and the eager step from then on
    (``run.fell_back`` then says so)."""
    _raise_recompile_limit()
    compiled = torch.compile(step_fn, dynamic=True, backend=backend)
    state = {"fn": compiled}

    def run(*args):
        try:
            return state["fn"](*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure: keep generating, eagerly
            if state["fn"] is step_fn:
                raise
            print(f"WARNING: torch.compile of the decode step failed ({type(e).__name__}: {str(e)[:200]}); "
                  "decoding eagerly", flush=True)
            state["fn"] = step_fn
            run.fell_back = True
            return step_fn(*args)
    run.fell_back = False
    return run


@dataclass
class _InFlight:
    """A launched decode step: its requests (slot order of the batch) and its tokens on their way to the host."""
    requests: List[InferenceRequest]
    batch: int
    want_lp: bool
    tokens: Optional[torch.Tensor] = None
    log_probs: Optional[torch.Tensor] = None
    event: Optional["torch.cuda.Event"] = None


def _refuse_chunked_prefill(model) -> None:
    """Chunked prefill continues each attention layer's cache; a recurrent layer (Mamba-2, Gated DeltaNet) would
    have to continue its state from one chunk to the next, and an image's tokens cannot be split."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet  # lazy: the SSM modules load with hybrid models
    from megatron.core.ssm.mamba_mixer import MambaMixer  # lazy: as above
    if hasattr(model, "expand_image_tokens"):
        raise NotImplementedError("--enable-chunked-prefill with a vision-language model is not supported: image "
                                  "tokens are prefilled whole; drop the flag")
    if any(isinstance(m, (GatedDeltaNet, MambaMixer)) for m in model.modules()):
        raise NotImplementedError("--enable-chunked-prefill with Mamba-2 or Gated DeltaNet layers is not supported "
                                  "yet (their state would continue across chunks); drop the flag")


class InferenceEngine:
    """``vocab_size``: the tokenizer's (padded vocab rows are never sampled); ``detokenize`` turns ids into
    text for stop words and ``generated_text``; ``use_cuda_graphs`` (default: True on CUDA) decodes in
    static-shape steps (batch and KV length rounded up to buckets) replayed from CUDA graphs; on CPU
    it runs those same bucketed steps eagerly, which is how the tests check what a graph replays;
    ``compile_decode`` runs the decode step through torch.compile (CUDA only; falls back to eager if
    compilation fails), fusing the element-wise work between the matmuls before graph capture;
    ``log_step_interval`` N > 0 prints one line of step statistics every N steps (`step_log.StepLog`);
    ``prefix_caching`` reuses the keys and values of prompt prefixes other slots hold, in whole blocks of
    ``prefix_block_size`` tokens, under ``prefix_eviction_policy`` (`prefix_cache.PrefixCache`)."""

    def __init__(self, model, max_batch_size: int = 8, max_sequence_length: int = 2560,
                 vocab_size: Optional[int] = None, termination_id: Optional[int] = None,
                 detokenize: Optional[Callable[[List[int]], str]] = None,
                 use_cuda_graphs: Optional[bool] = None, compile_decode: bool = False,
                 max_prefill_tokens: int = 16384, log_step_interval: int = 0, num_batch_graphs: int = 16,
                 chunked_prefill: bool = False, graph_sizing: str = "exponential", prefix_caching: bool = False,
                 prefix_block_size: int = 256, prefix_eviction_policy: str = "ref_zero"):
        if parallel_state.model_parallel_is_initialized() and \
                parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise NotImplementedError("text generation runs with --pipeline-model-parallel-size 1 only; load the "
                                      "checkpoint at PP=1 (torch_dist checkpoints reshard on load)")
        self.model = unwrap_model(model).eval()  # Float16Module / DDP: the bare GPTModel (params already cast)
        self.step_log = StepLog(log_step_interval, show_reused=prefix_caching)
        self.tokens_generated = 0  # every token appended to a request, prefill's first ones included
        self.multimodal = hasattr(self.model, "expand_image_tokens")  # LLaVAModel: prompts may carry images
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.vocab_size = vocab_size or self.model.vocab_size
        self.termination_id, self.detokenize = termination_id, detokenize
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.max_prefill_tokens = max_prefill_tokens
        # --enable-chunked-prefill: a prompt longer than max_prefill_tokens is prefilled in chunks of at most that
        # many tokens (each attending to the cached ones before it), so one forward's activations stay bounded.
        self.chunked_prefill = chunked_prefill
        if chunked_prefill:
            _refuse_chunked_prefill(self.model)
        self.prefix_cache = None
        if prefix_caching:
            refuse_prefix_caching(self.model)
            self.prefix_cache = PrefixCache(max_batch_size, prefix_block_size, prefix_eviction_policy)
        # The decode steps' batch sizes under CUDA graphs (one graph per size and KV-length bucket).
        self.batch_sizes = batch_ladder(max_batch_size, num_batch_graphs, graph_sizing)
        self.context = StaticInferenceContext(max_batch_size, max_sequence_length)
        self.slots: List[Optional[InferenceRequest]] = [None] * max_batch_size
        self.waiting: deque = deque()
        self._ids = itertools.count()
        self.peak_active = 0  # most requests decoded together so far (a serving statistic)
        n, dev = max_batch_size, self.device
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)  # last token of each slot
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)  # its position
        self.temperature = torch.ones(n, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(n, dtype=torch.long, device=dev)
        self.top_p = torch.zeros(n, dtype=torch.float32, device=dev)
        self.uniform = torch.zeros(n, dtype=torch.float32, device=dev)
        self.out_tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.out_log_probs = torch.zeros(n, dtype=torch.float32, device=dev)
        self._in_flight: Optional[_InFlight] = None
        self._flip = 0
        if dev.type == "cuda":
            self._host_tokens = [torch.empty(n, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self._host_log_probs = [torch.empty(n, dtype=torch.float32, pin_memory=True) for _ in range(2)]
            self._host_uniform = [torch.empty(n, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        if use_cuda_graphs is None:
            use_cuda_graphs = dev.type == "cuda"
        self._step_fn = self._decode_step
        if compile_decode and dev.type == "cuda":
            self._step_fn = _compiled(self._decode_step)
        self.graphs = DecodeGraphs(self._step_fn,
                                   lambda: [self.tokens, self.positions, *self.context.recurrent_buffers()],
                                   capture=dev.type == "cuda") if use_cuda_graphs else None

    # ---------------------------------------------------------------- requests
    def prepare_prompt(self, prompt_tokens: Sequence[int], sampling_params: SamplingParams,
                       images: Optional[torch.Tensor] = None,
                       num_image_tiles: Optional[Sequence[int]] = None) -> List[int]:
        """The token sequence the model will see (image tokens expanded to their feature positions), after
        ``check_request``; ValueError (one line) when the request cannot run. ``images`` [tiles, c, H, W]:
        the tiles of the prompt's images in order; ``num_image_tiles``: tiles per image (default 1 each)."""
        tokens = [int(t) for t in prompt_tokens]
        if images is not None and not self.multimodal:
            raise ValueError("this model takes no images (a vision-language model such as pretrain_vlm.py's does)")
        if self.multimodal:
            n_tiles = 0 if images is None else images.shape[0]
            tiles = [1] * n_tiles if num_image_tiles is None else [int(n) for n in num_image_tiles]
            if sum(tiles) != n_tiles:
                raise ValueError(f"num_image_tiles {tiles} adds up to {sum(tiles)} tiles but {n_tiles} were given")
            tokens = self.model.expand_image_tokens(tokens, tiles)
        self.check_request(len(tokens), sampling_params)
        return tokens

    def check_request(self, num_prompt_tokens: int, sampling_params: SamplingParams) -> None:
        """Raise ValueError (a one-line reason) when a request cannot run; touches no engine state."""
        sampling_params.validate()
        n = num_prompt_tokens
        m = sampling_params.tokens_to_generate(n, self.max_sequence_length)
        if m < 0:
            raise ValueError(f"num_tokens_total ({sampling_params.num_tokens_total}) is shorter than the prompt "
                             f"({n} tokens)")
        if n == 0:
            raise ValueError("the prompt is empty (send text, or set add_BOS)")
        if n + m > self.max_sequence_length:
            raise ValueError(f"prompt ({n} tokens) + tokens_to_generate ({m}) exceeds the context of "
                             f"{self.max_sequence_length} tokens")
        if m == 0 and not sampling_params.return_log_probs:
            raise ValueError("tokens_to_generate=0 only makes sense with logprobs=true")

    def add_request(self, prompt_tokens: Sequence[int], sampling_params: SamplingParams,
                    done=None, images: Optional[torch.Tensor] = None,
                    num_image_tiles: Optional[Sequence[int]] = None) -> InferenceRequest:
        """Queue a prompt (``done``: an Event to set when it finishes; ``images`` / ``num_image_tiles``: see
        ``prepare_prompt``); ValueError when it cannot run."""
        tokens = self.prepare_prompt(prompt_tokens, sampling_params, images, num_image_tiles)
        # The request keeps its own copy with the token count resolved (None: up to the max length).
        sampling_params = dataclasses.replace(sampling_params, num_tokens_total=None, num_tokens_to_generate=(
            sampling_params.tokens_to_generate(len(tokens), self.max_sequence_length)))
        req = InferenceRequest(next(self._ids), tokens, sampling_params)
        if len(tokens) != len(prompt_tokens):
            req.input_prompt_tokens = [int(t) for t in prompt_tokens]
            req.num_image_tiles = [1] * images.shape[0] if num_image_tiles is None else list(num_image_tiles)
        if images is not None and images.shape[0]:
            req.images = images.detach().to("cpu")
        if done is not None:
            req.done = done
        self.waiting.append(req)
        return req

    def abort_all(self, reason: str) -> None:
        """Finish every waiting and active request with ``reason`` (after a failed step) and start clean."""
        for req in list(self.waiting) + [r for r in self.slots if r is not None]:
            req.finish_reason, req.status = reason, Status.COMPLETED
            req.done.set()
        self.waiting.clear()
        self.slots = [None] * self.max_batch_size
        self._in_flight = None
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots) or self._in_flight is not None

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams]],
                 images: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 num_image_tiles: Optional[Sequence[Optional[Sequence[int]]]] = None) -> List[InferenceRequest]:
        """Run ``prompts`` (token lists) to completion; returns their requests in order. ``images`` /
        ``num_image_tiles``: per prompt (None for a text-only prompt), see ``prepare_prompt``."""
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else sampling_params
        images = images or [None] * len(prompts)
        num_image_tiles = num_image_tiles or [None] * len(prompts)
        reqs = [self.add_request(p, sp, images=im, num_image_tiles=nt)
                for p, sp, im, nt in zip(prompts, params, images, num_image_tiles)]
        while not all(r.status is Status.COMPLETED for r in reqs):
            self.step()
        if self._in_flight is not None and not self.waiting and all(r is None for r in self.slots):
            self.step()  # collect the step still in flight (a request stopped by EOD before it)
        return reqs

    @torch.inference_mode()
    def step(self) -> List[InferenceRequest]:
        """Admit what fits, then decode one token for every active request; returns the finished ones."""
        finished: List[InferenceRequest] = []
        admitted, generated_before = [], self.tokens_generated
        reused_before = self.prefix_cache.reused_tokens if self.prefix_cache is not None else 0
        while self.waiting and None in self.slots:
            req = self.waiting.popleft()
            req.slot, req.status = self._free_slot(req), Status.ACTIVE
            self.slots[req.slot] = req
            admitted.append(req)
        if admitted:
            self._prefill(admitted, finished)
        # Launch this step before reading the previous one's tokens: the host's bookkeeping then overlaps
        # the device's work. A request is known finished one step late; its extra token is dropped.
        active = [r for r in self.slots if r is not None]
        ahead = set(map(id, self._in_flight.requests)) if self._in_flight is not None else set()
        # No step when the one in flight completes every request's length budget anyway.
        needed = any(len(r.generated_tokens) + (id(r) in ahead) < r.sampling_params.num_tokens_to_generate
                     and r.length + (id(r) in ahead) < self.max_sequence_length for r in active)
        launched = self._launch(active, ahead) if needed else None
        if self._in_flight is not None:
            self._collect(self._in_flight, finished)
        self._in_flight = launched
        if self.step_log.interval:
            reused = self.prefix_cache.reused_tokens - reused_before if self.prefix_cache is not None else 0
            self.step_log.step(len(active), len(self.waiting), sum(len(r.prompt_tokens) for r in admitted),
                               self.tokens_generated - generated_before, reused)
        return finished

    def _free_slot(self, req: InferenceRequest) -> int:
        free = [i for i, r in enumerate(self.slots) if r is None]
        return free[0] if self.prefix_cache is None else self.prefix_cache.choose_slot(req.prompt_tokens, free)

    # ---------------------------------------------------------------- prefill
    def _prefill(self, reqs: List[InferenceRequest], finished) -> None:
        """With prefix caching: requests whose prompt starts with whole blocks another slot holds (or will
        hold once this step's other prompts are prefilled) wait until the others are, then prefill one by one
        from the prefix copied into their slot. Prompt log-probs need every prompt position's logits: those
        requests prefill whole (and give their prefix to later ones)."""
        cache = self.prefix_cache
        if cache is None:
            return self._prefill_whole(reqs, finished)
        whole, reusing = [], []
        for req in sorted(reqs, key=lambda r: len(r.prompt_tokens)):
            shares = cache.match(req.prompt_tokens, req.slot)[1] or any(
                cache.common_blocks(w.prompt_tokens, req.prompt_tokens) for w in whole)
            (reusing if shares and not req.sampling_params.return_log_probs else whole).append(req)
        self._prefill_whole(whole, finished)
        cache.computed_tokens += sum(len(r.prompt_tokens) for r in whole)
        for req in reusing:
            donor, length = cache.reuse(req.prompt_tokens, req.slot)  # again: this step's prefills hold prompts now
            if donor is not None and donor != req.slot:
                self.context.copy_prefix(donor, req.slot, length)
            chunk = self.max_prefill_tokens if self.chunked_prefill else None
            self._prefill_batch([req], finished, all_logits=False, chunk=chunk, start=length)

    def _prefill_whole(self, reqs: List[InferenceRequest], finished) -> None:
        """Batched prefill of requests that need only next-token logits; one by one for prompt log-probs (and,
        with chunked prefill, for a prompt longer than max_prefill_tokens)."""
        batch = []
        for req in sorted(reqs, key=lambda r: len(r.prompt_tokens)):
            if self.chunked_prefill and len(req.prompt_tokens) > self.max_prefill_tokens:
                self._prefill_batch([req], finished, all_logits=req.sampling_params.return_log_probs,
                                    chunk=self.max_prefill_tokens)
                continue
            if req.sampling_params.return_log_probs:
                self._prefill_batch([req], finished, all_logits=True)
                continue
            if batch and (len(batch) + 1) * len(req.prompt_tokens) > self.max_prefill_tokens:
                self._prefill_batch(batch, finished, all_logits=False)
                batch = []
            batch.append(req)
        if batch:
            self._prefill_batch(batch, finished, all_logits=False)

    def _prefill_batch(self, reqs: List[InferenceRequest], finished, all_logits: bool,
                       chunk: Optional[int] = None, start: int = 0) -> None:
        """``chunk`` / ``start`` (one request): its prompt from position ``start`` (the positions before it are
        cached) in chunks of at most ``chunk`` tokens (None: one chunk)."""
        lengths = [len(r.prompt_tokens) for r in reqs]
        s, dev = max(lengths), self.device
        slots = torch.tensor([r.slot for r in reqs], device=dev)
        if chunk is not None or start:  # one request, its prompt in chunks of at most `chunk` tokens
            logits = self._prefill_chunks(reqs[0], slots, chunk or lengths[0], all_logits, start)
        else:
            tokens = torch.tensor([r.prompt_tokens + [0] * (s - len(r.prompt_tokens)) for r in reqs], device=dev)
            positions = torch.arange(s, device=dev).expand(len(reqs), s)
            last = torch.tensor([n - 1 for n in lengths], device=dev)
            self.context.set_prefill(slots, None if all_logits else last)
            images = [r.images for r in reqs if r.images is not None]
            images = torch.cat(images).to(dev, self.dtype) if images else None  # every tile, in batch order
            logits = self._forward(tokens, positions, images)  # [b, s or 1, V]
        for r in reqs:
            r.images = None  # its features are in the KV cache now
            if self.prefix_cache is not None:
                self.prefix_cache.hold(r.slot, r.prompt_tokens)
        if all_logits:  # one request: its prompt log-probs too
            req, n = reqs[0], lengths[0]
            req.prompt_log_probs = self._prompt_log_probs(req, logits[0, :n - 1])
            logits = logits[:, n - 1]
        else:
            logits = logits[:, -1]
        params = [r.sampling_params for r in reqs]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        uniform = torch.tensor([r.rng.random() for r in reqs], dtype=torch.float32, device=dev)
        first = sample_tokens(logits, temperature, top_k, top_p, uniform, all(p.greedy for p in params))
        log_probs = token_log_probs(logits, first)
        # Seed each slot's decode state: its first token, at position len(prompt).
        self.tokens[slots] = first
        self.positions[slots] = torch.tensor(lengths, device=dev)
        self.temperature[slots], self.top_k[slots], self.top_p[slots] = temperature, top_k, top_p
        for req, token, lp in zip(reqs, first.tolist(), log_probs.tolist()):
            if req.sampling_params.num_tokens_to_generate == 0:
                self._finish(req, "length", finished)
            else:
                self._append(req, token, lp, finished)

    def _prefill_chunks(self, req: InferenceRequest, slots: torch.Tensor, chunk: int, all_logits: bool,
                        begin: int = 0):
        """The prompt's chunks from position ``begin`` one forward each, every one attending to the cached
        positions before it; the logits the unchunked forward would give: every position's (from ``begin``)
        with ``all_logits``, else the last one's."""
        n, dev, parts = len(req.prompt_tokens), self.device, []
        for start in range(begin, n, chunk):
            piece = req.prompt_tokens[start:start + chunk]
            tokens = torch.tensor([piece], device=dev)
            positions = torch.arange(start, start + len(piece), device=dev)[None]
            last = None if all_logits else torch.tensor([len(piece) - 1], device=dev)
            self.context.set_prefill(slots, last, start=start)
            parts.append(self._forward(tokens, positions))  # [1, len(piece) or 1, V]
        self.context.prefill_start = 0
        return torch.cat(parts, dim=1) if all_logits else parts[-1]

    def _prompt_log_probs(self, req: InferenceRequest, logits: torch.Tensor) -> List[Optional[float]]:
        """Log-probs of the given prompt's tokens 1..n-1 from the logits [n_model - 1, V] of the model's
        sequence; an image token (expanded or not) has none."""
        targets = torch.tensor(req.prompt_tokens[1:], device=logits.device)
        in_vocab = (targets >= 0) & (targets < logits.shape[-1])
        lps = token_log_probs(logits, targets.clamp(0, logits.shape[-1] - 1)).tolist()
        if req.input_prompt_tokens is None:
            return [lp if ok else None for lp, ok in zip(lps, in_vocab.tolist())]
        image, tiles = self.model.image_token_index, iter(req.num_image_tiles)
        out, pos = [], 0  # pos: where given token j starts in the model's sequence
        for j, t in enumerate(req.input_prompt_tokens):
            if j:
                out.append(None if t == image else lps[pos - 1])
            pos += next(tiles) * self.model.img_seq_len if t == image else 1
        return out

    # ---------------------------------------------------------------- decode
    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                 images: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.multimodal:
            logits, _ = self.model(images, tokens, positions, None, inference_context=self.context,
                                   runtime_gather_output=True)
        else:
            logits = self.model(tokens, positions, None, inference_context=self.context, runtime_gather_output=True)
        return logits[..., :self.vocab_size].float()

    def _decode_step(self, batch: int, kv_len: int, greedy_only: bool) -> None:
        """One token for slots 0..batch-1: static shapes, buffers only (the body of a CUDA graph)."""
        positions = self.positions[:batch]
        self.context.set_decode(positions, kv_len, self.dtype)
        logits = self._forward(self.tokens[:batch, None], positions[:, None])[:, -1]  # [B, V]
        nxt = sample_tokens(logits, self.temperature[:batch], self.top_k[:batch], self.top_p[:batch],
                            self.uniform[:batch], greedy_only)
        self.out_log_probs[:batch].copy_(token_log_probs(logits, nxt))
        self.out_tokens[:batch].copy_(nxt)
        self.tokens[:batch].copy_(nxt)
        # Idle slots in the batch keep stepping on garbage; clamping keeps their writes in the cache.
        self.positions[:batch].copy_((positions + 1).clamp_max(self.max_sequence_length - 1))

    def _launch(self, active: List[InferenceRequest], ahead) -> _InFlight:
        """Queue one decode step for ``active`` and an asynchronous copy of its tokens to the host;
        ``ahead``: ids of the requests with a token in the step still in flight."""
        self.peak_active = max(self.peak_active, len(active))
        eager = self.graphs is None
        top = max(r.slot for r in active) + 1
        # The fed token sits at position length - 1, counting the token of the step still in flight.
        longest = min(max(r.length + (id(r) in ahead) for r in active), self.max_sequence_length)
        batch = top if eager else ladder_bucket(top, self.batch_sizes)
        kv_len = longest if eager else bucket(longest, self.max_sequence_length, minimum=64)
        greedy_only = all(r.sampling_params.greedy for r in active)
        cuda = self.device.type == "cuda"
        if cuda:  # pinned double buffers: the copies of the step before may still be pending on the other one
            self._flip ^= 1
        if not greedy_only:
            draws = [0.5] * batch
            for r in active:
                draws[r.slot] = r.rng.random()
            draws = torch.tensor(draws, dtype=torch.float32)
            if cuda:  # a pageable host->device copy would wait for the step in flight; this one queues behind it
                self.uniform[:batch].copy_(self._host_uniform[self._flip][:batch].copy_(draws), non_blocking=True)
            else:
                self.uniform[:batch].copy_(draws)
        if eager:
            self._step_fn(batch, kv_len, greedy_only)
        else:
            self.graphs.run(batch, kv_len, greedy_only)
        want_lp = any(r.sampling_params.return_log_probs for r in active)
        out = _InFlight(list(active), batch, want_lp)
        if cuda:
            out.tokens = self._host_tokens[self._flip][:batch].copy_(self.out_tokens[:batch], non_blocking=True)
            if want_lp:
                out.log_probs = self._host_log_probs[self._flip][:batch].copy_(self.out_log_probs[:batch],
                                                                               non_blocking=True)
            out.event = torch.cuda.Event()
            out.event.record()
        else:
            out.tokens = self.out_tokens[:batch].clone()
            out.log_probs = self.out_log_probs[:batch].clone() if want_lp else None
        return out

    def _collect(self, step: _InFlight, finished) -> None:
        """Append a launched step's tokens (the one host sync per step); requests that finished while it
        was in flight computed one token too many, which is dropped here."""
        if step.event is not None:
            step.event.synchronize()
        tokens = step.tokens.tolist()
        log_probs = step.log_probs.tolist() if step.want_lp else None
        for r in step.requests:
            if r.status is Status.ACTIVE:
                self._append(r, tokens[r.slot], log_probs[r.slot] if step.want_lp else None, finished)

    # ---------------------------------------------------------------- bookkeeping
    def _append(self, req: InferenceRequest, token: int, log_prob, finished) -> None:
        req.generated_tokens.append(token)
        self.tokens_generated += 1
        if log_prob is not None and req.sampling_params.return_log_probs:
            req.generated_log_probs.append(log_prob)
        sp = req.sampling_params
        termination_id = self._termination_id(sp)
        if termination_id is not None and token == termination_id:
            self._finish(req, "stop", finished)
        elif sp.stop_words and self.detokenize is not None and \
                any(w in self.detokenize(req.generated_tokens) for w in sp.stop_words):
            self._finish(req, "stop", finished)
        elif len(req.generated_tokens) >= sp.num_tokens_to_generate or req.length >= self.max_sequence_length:
            self._finish(req, "length", finished)

    def _termination_id(self, sp: SamplingParams):
        """The request's own termination id, else the engine's (end of document)."""
        return sp.termination_id if sp.termination_id is not None else self.termination_id

    def _finish(self, req: InferenceRequest, reason: str, finished) -> None:
        req.finish_reason, req.status = reason, Status.COMPLETED
        self.slots[req.slot] = None
        if self.prefix_cache is not None:  # the slot holds every token fed so far: the last generated one is not
            self.prefix_cache.release(req.slot, req.prompt_tokens + req.generated_tokens[:-1])
        if self.detokenize is not None:
            ids = req.generated_tokens
            termination_id = self._termination_id(req.sampling_params)
            if ids and termination_id is not None and ids[-1] == termination_id:
                ids = ids[:-1]
            text = self.detokenize(ids)
            cuts = [text.index(w) for w in req.sampling_params.stop_words or [] if w and w in text]
            req.generated_text = text[:min(cuts)] if cuts else text  # up to the first stop word
        finished.append(req)
        req.done.set()
