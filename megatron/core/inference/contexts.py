"""StaticInferenceContext: the KV cache of a generation run and the metadata of the forward in flight.

The cache is preallocated per *slot* and maximum length: keys and values of each layer are
``[slots, ng, max_len, hn]`` views of one ``[slots, ng, max_len, 2, hn]`` buffer (ng = this rank's query
groups). A request owns one slot from admission
to finish, so requests of different lengths join and leave a running batch without moving anything.
Positions at or beyond a slot's length hold stale values; no query reads them (prefill is causal, and
a decode query at position p is masked to positions <= p after writing its own key at p).

Two kinds of forward use it (GPTModel passes it down to attention as ``inference_context``):
- prefill: ``slot_ids`` [b] prompts, right-padded to a common length s, write positions [0, s) of
  their slots and attend causally among themselves;
- decode: one token for each of slots 0..B-1 at ``decode_positions`` [B], attending over the cache
  slice [0, kv_len) of those slots. Shapes depend only on (B, kv_len): a CUDA graph per pair replays it.

Recurrent layers (Mamba-2, Gated DeltaNet) keep, per slot, a fixed-size state instead of a growing cache
(``recurrent_state``): prefill sets it from the prompt (each row up to its own length, ``prefill_lengths``),
a decode step advances it by one token in place.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.inference.decode_fusions import rope_and_store
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention_sinks import with_sink


class StaticInferenceContext:
    def __init__(self, max_batch_size: int, max_sequence_length: int,
                 materialize_only_last_token_logits: bool = True):
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.materialize_only_last_token_logits = materialize_only_last_token_logits
        self.key_value_memory_dict = {}  # layer_number -> (keys, values), allocated on first use
        self._kv = {}  # layer_number -> the [slots, ng, max_len, 2, hn] buffer behind those two views
        self._rotary = None  # (rotary module, [max_len, 1, 1, d] frequency table)
        self._rope = None  # this forward's (freqs, cos, signed sin, interleaved), or None without RoPE
        self.decode = False
        self.slot_ids: Optional[torch.Tensor] = None  # prefill: [b] slots being filled
        self.last_token_index: Optional[torch.Tensor] = None  # prefill: [b] each row's last prompt index
        self.decode_positions: Optional[torch.Tensor] = None  # decode: [B] position of each new token
        self.kv_len = 0  # decode: attend over cache positions [0, kv_len)
        self.window_size = None  # (left, right) sliding window of the model (--window-size), or None
        self._decode_mask = None
        self._decode_mask_full = None  # without the window, for the layers window_layers leaves out
        self.window_layers = None  # layer_number -> bool: the layers the window applies to (None: all)
        self._mask_dtype = torch.float32
        self._recurrent = {}  # layer_number -> tuple of [slots, ...] state buffers (recurrent layers)
        self.prefill_start = 0  # chunked prefill: the position of this forward's first token

    def is_static_batching(self) -> bool:
        return True

    def is_decode_only(self) -> bool:
        return self.decode

    def set_prefill(self, slot_ids: torch.Tensor, last_token_index: Optional[torch.Tensor], start: int = 0) -> None:
        """Next forward fills ``slot_ids``; logits only at ``last_token_index`` (None: every position).
        ``start`` > 0 (chunked prefill, one slot): the forward's tokens sit at positions [start, start + s) and
        attend to the slot's cached positions before them too."""
        if start and len(slot_ids) != 1:
            raise ValueError("a prefill chunk after position 0 fills one slot at a time")
        self.decode, self.slot_ids, self.last_token_index = False, slot_ids, last_token_index
        self.prefill_start = start

    @property
    def prefill_lengths(self) -> Optional[torch.Tensor]:
        """Prefill: [b] prompt length of each (right-padded) row; None when every row fills the batch
        (the engine asks for all logits of one request at a time)."""
        return None if self.last_token_index is None else self.last_token_index + 1

    def recurrent_state(self, layer_number: int, specs) -> tuple:
        """The layer's per-slot state buffers, zeros on first use: one [slots, *shape] tensor per
        (shape, dtype, device) in ``specs``."""
        if layer_number not in self._recurrent:
            self._recurrent[layer_number] = tuple(
                torch.zeros((self.max_batch_size,) + tuple(shape), dtype=dtype, device=device)
                for shape, dtype, device in specs)
        return self._recurrent[layer_number]

    def recurrent_buffers(self) -> list:
        """Every recurrent layer's per-slot state tensors: what a decode step updates in place besides the
        KV cache (a CUDA graph's warm-up step must put them back)."""
        return [t for states in self._recurrent.values() for t in states]

    def set_decode(self, positions: torch.Tensor, kv_len: int, dtype: torch.dtype = torch.float32) -> None:
        """Next forward decodes slots 0..B-1 (B = len(positions)); runs inside a captured graph too."""
        self.decode, self.decode_positions, self.kv_len, self._mask_dtype = True, positions, kv_len, dtype
        self.last_token_index = None

    def begin_forward(self, rotary_module, position_ids: torch.Tensor, window_size=None, rotary_freqs=None,
                      window_layers=None) -> None:
        """Called by the model before its layers: what every layer shares in this forward, computed once:
        RoPE cos/sin for the [b, s] positions (``rotary_module`` None: no RoPE) and the decode masks.
        ``rotary_freqs`` [s, b, 1, d]: angles the model computed itself (multimodal RoPE), used as given.
        ``window_layers(layer_number)``: whether ``window_size`` applies to that layer (None: to every layer;
        --window-attn-skip-freq)."""
        self.window_size, self.window_layers = window_size, window_layers
        self._rope = None
        if rotary_module is not None:
            if rotary_freqs is not None:
                freqs = rotary_freqs
            else:
                if self._rotary is None or self._rotary[0] is not rotary_module:
                    self._rotary = (rotary_module, rotary_module(self.max_sequence_length))  # [max_len, 1, 1, d]
                freqs = self._rotary[1][position_ids.t()].squeeze(2)  # [s, b, 1, d]
            half = freqs.shape[-1] // 2
            # rotate_half(t) = roll(t, d/2) with the first half negated: fold that sign into sin.
            sign = torch.ones(freqs.shape[-1], device=freqs.device)
            sign[:half] = -1
            self._rope = [freqs, freqs.cos(), freqs.sin() * sign, rotary_module.rotary_interleaved]
        if self.decode:
            positions = self.decode_positions
            cols = torch.arange(self.kv_len, device=positions.device)
            causal = cols[None, :] <= positions[:, None]
            allowed = causal
            if window_size is not None and window_size[0] >= 0:  # sliding window: the last left+1 keys
                allowed = causal & (cols[None, :] >= positions[:, None] - window_size[0])
            # Additive masks shared by the layers (SDPA would convert a boolean one in each call).
            zero = torch.zeros((), dtype=self._mask_dtype, device=positions.device)
            self._decode_mask = zero.masked_fill(~allowed.view(-1, 1, 1, self.kv_len), float("-inf"))
            self._decode_mask_full = None
            if window_layers is not None and allowed is not causal:
                self._decode_mask_full = zero.masked_fill(~causal.view(-1, 1, 1, self.kv_len), float("-inf"))

    def _apply_rope(self, t: torch.Tensor) -> torch.Tensor:
        freqs, cos, sin, interleaved = self._rope
        if interleaved or freqs.shape[-1] != t.shape[-1]:  # the general path (partial / interleaved)
            return apply_rotary_pos_emb(t, freqs, rotary_interleaved=interleaved)
        if cos.dtype != t.dtype:  # cast once per forward, by the first layer
            self._rope[1], self._rope[2] = cos, sin = cos.to(t.dtype), sin.to(t.dtype)
        return torch.addcmul(t * cos, torch.roll(t, t.shape[-1] // 2, dims=-1), sin)

    def _cache(self, layer_number: int, k: torch.Tensor) -> torch.Tensor:
        """The layer's [slots, ng, max_len, 2, hn] buffer (``key_value_memory_dict`` holds its key and value
        views): a decode step writes a token's key and value, adjacent in the fused projection, at once."""
        if layer_number not in self._kv:
            ng, hn = k.shape[-2], k.shape[-1]
            kv = torch.zeros((self.max_batch_size, ng, self.max_sequence_length, 2, hn), dtype=k.dtype,
                             device=k.device)
            self._kv[layer_number] = kv
            self.key_value_memory_dict[layer_number] = (kv[..., 0, :], kv[..., 1, :])
        return self._kv[layer_number]

    def attention(self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  softmax_scale: float, sink: Optional[torch.Tensor] = None, rope: bool = True) -> torch.Tensor:
        """Store k/v in the cache and attend. q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np * hn].
        ``sink`` [np]: the heads' sink logits (--softmax-type; attention_sinks.py). ``rope=False``: a layer that
        skips the model's rotary embedding (--no-rope-freq)."""
        if self._rope is not None and rope:
            q, k = self._apply_rope(q), self._apply_rope(k)
        kv = self._cache(layer_number, k)
        s, b, np_, hn = q.shape
        ng = k.shape[2]
        keys, values = kv[..., 0, :], kv[..., 1, :]  # [slots, ng, max_len, hn] each
        if self.decode:
            if torch.compiler.is_compiling():  # an index_put on the whole cache: inductor updates it in place
                rows = torch.arange(b, device=q.device)  # slot i's key and value at decode_positions[i]
                kv[rows, :, self.decode_positions] = torch.stack((k[0], v[0]), dim=2)  # [B, ng, 2, hn]
            else:  # eager: one scatter kernel per tensor
                index = self.decode_positions.view(b, 1, 1, 1).expand(b, ng, 1, hn)
                keys[:b].scatter_(2, index, k[0].unsqueeze(2))
                values[:b].scatter_(2, index, v[0].unsqueeze(2))
            query = q[0].view(b, ng, np_ // ng, hn)
            if sink is not None:
                return self._attend_decode_with_sink(kv, query, softmax_scale, self._layer_decode_mask(layer_number),
                                                     sink)
            return self._attend_decode(kv, query, softmax_scale, self._layer_decode_mask(layer_number))
        start = self.prefill_start
        rows = self.slot_ids[:, None]  # [b, 1]
        cols = torch.arange(s, device=q.device)[None, :]  # [1, s]
        keys[rows, :, cols + start] = k.transpose(0, 1)  # [b, s, ng, hn] into [b, ng, s, hn] slices
        values[rows, :, cols + start] = v.transpose(0, 1)
        qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, hn]
        band = None
        windowed = self.window_layers is None or self.window_layers(layer_number)
        if start:  # a later chunk: the slot's keys and values from position 0, this chunk's included
            kh, vh = keys[self.slot_ids, :, :start + s], values[self.slot_ids, :, :start + s]
            i = torch.arange(s, device=q.device)[:, None] + start
            cols = torch.arange(start + s, device=q.device)[None, :]
            band = cols <= i  # [s, start + s], True = attend
            if self.window_size is not None and self.window_size[0] >= 0 and windowed:
                band = band & (cols >= i - self.window_size[0])
        elif self.window_size is not None and self.window_size[0] >= 0 and windowed:
            i = torch.arange(s, device=q.device)[:, None]
            band = (cols <= i) & (cols >= i - self.window_size[0])  # [s, s], True = attend
        if sink is not None:  # the sink key per query head: K/V repeated to every head
            kh, vh = kh.repeat_interleave(np_ // ng, dim=1), vh.repeat_interleave(np_ // ng, dim=1)
            qh, kh, vh, band = with_sink(qh, kh, vh, sink, softmax_scale, band, band is None)
            ctx = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=band, scale=softmax_scale)[..., :hn]
        else:
            ctx = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=band, is_causal=band is None,
                                                 scale=softmax_scale, enable_gqa=ng != np_)  # [b, np, s, hn]
        return ctx.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)

    def _layer_decode_mask(self, layer_number: int) -> torch.Tensor:
        """The decode mask of this layer: without the window where ``window_layers`` leaves the layer out."""
        if self._decode_mask_full is not None and not self.window_layers(layer_number):
            return self._decode_mask_full
        return self._decode_mask

    def _attend_decode_with_sink(self, kv: torch.Tensor, query: torch.Tensor, softmax_scale: float,
                                 mask: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        """`_attend_decode` with the heads' sink logits (query heads in (group, member) order, as ``sink``): one
        query per slot, so the scores are small enough to write out: softmax over [sink, scores], the sink's
        column dropped, times the values."""
        b, ng, r, hn = query.shape
        window = kv[:b, :, :self.kv_len]  # [B, ng, L, 2, hn]
        scores = torch.matmul(query.float(), window[..., 0, :].float().transpose(-1, -2)) * softmax_scale
        scores = scores + mask.float()  # [B, ng, r, L]; the additive mask [B, 1, 1, L]
        col = sink.float().view(1, ng, r, 1).expand(b, ng, r, 1)
        probs = torch.softmax(torch.cat([col, scores], dim=-1), dim=-1)[..., 1:]
        ctx = torch.matmul(probs, window[..., 1, :].float()).to(query.dtype)  # [B, ng, r, hn]
        return ctx.reshape(1, b, -1)

    def _attend_decode(self, kv: torch.Tensor, query: torch.Tensor, softmax_scale: float,
                       mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query [B, ng, np/ng, hn] over the cache slice [0, kv_len) of slots 0..B-1 -> [1, B, np * hn].

        GQA without copies: the np/ng query heads of a group act as that group's query "positions", all
        at the same sequence position, so one [B, ng, np/ng, L] attention covers them. The key and value
        views are taken here from the one cache buffer (also inside a compiled step: two aliasing views
        as graph inputs, one of them written, would make the compiler copy the whole buffer)."""
        b = query.shape[0]
        window = kv[:b, :, :self.kv_len]  # [B, ng, L, 2, hn]
        ctx = F.scaled_dot_product_attention(query, window[..., 0, :], window[..., 1, :],
                                             attn_mask=self._decode_mask if mask is None else mask,
                                             scale=softmax_scale)
        return ctx.reshape(1, b, -1)  # heads in (group, member) order, as the projection lays them out

    def attention_from_qkv(self, layer_number: int, mixed: torch.Tensor, ng: int, hn: int,
                           softmax_scale: float) -> torch.Tensor:
        """``attention`` from the fused QKV projection [s, b, ng * (np/ng + 2) * hn] (SelfAttention's layout:
        per group its queries, key, value). A decode step hands it whole to ``rope_and_store`` (RoPE on
        the queries and keys together, key and value into the cache in one write: one compiled kernel
        on CUDA) and attends with the queries where they lie, without splitting or copying them."""
        s, b = mixed.shape[:2]
        x = mixed.view(s, b, ng, -1, hn)  # [s, b, ng, np/ng + 2, hn]
        rep = x.shape[3] - 2
        general_rope = self._rope is not None and (self._rope[3] or self._rope[0].shape[-1] != hn)
        if not self.decode or general_rope:
            q = x[:, :, :, :rep].reshape(s, b, ng * rep, hn)
            return self.attention(layer_number, q, x[:, :, :, rep], x[:, :, :, rep + 1], softmax_scale)
        cos = sin = None
        if self._rope is not None:
            _, cos, sin, _ = self._rope  # [1, B, 1, hn]
            if cos.dtype != mixed.dtype:  # cast once per forward, by the first layer
                self._rope[1], self._rope[2] = cos, sin = cos.to(mixed.dtype), sin.to(mixed.dtype)
            cos, sin = cos.unsqueeze(3), sin.unsqueeze(3)  # [1, B, 1, 1, hn]
        kv = self._cache(layer_number, x[:, :, :, rep])  # [slots, ng, max_len, 2, hn]
        query = rope_and_store(x, cos, sin, kv, self.decode_positions)  # [B, ng, np/ng, hn]
        return self._attend_decode(kv, query, softmax_scale, self._layer_decode_mask(layer_number))

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Every attention layer's keys and values at positions [0, length) of slot ``src`` into slot ``dst``
        (prefix caching: a prompt starting with tokens another slot holds prefills only the rest)."""
        for kv in self._kv.values():  # [slots, ng, max_len, 2, hn]
            kv[dst, :, :length] = kv[src, :, :length]

    def reset(self) -> None:
        """Drop the cache (a new run with other shapes); slots are managed by the engine."""
        self.key_value_memory_dict.clear()
        self._kv.clear()
        self._recurrent.clear()
        self._rotary = self._rope = None
