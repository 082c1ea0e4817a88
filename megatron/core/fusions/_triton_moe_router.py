"""The Triton kernels behind ``moe_router`` (imported only where Triton builds kernels).

One program per token holds its E router logits in registers: the score function, the (group-limited, biased)
top-k selection by k rounds of arg-max (the lowest index wins a tie), the normalisation and the scaling, and
writes the token's rows of the dense probabilities and the routing map. The backward recomputes the scores from
the logits and the saved map. SCORE: 0 softmax, 1 sigmoid, 2 sqrt(softplus).
"""
import triton
import triton.language as tl


@triton.jit
def _log1p(y):
    return tl.where(y < 1e-4, y - 0.5 * y * y, tl.log(1.0 + y))


@triton.jit
def _positive(x, SCORE: tl.constexpr):
    """sigmoid (1) or sqrt(softplus) (2) of the fp32 logits."""
    if SCORE == 1:
        return 1.0 / (1.0 + tl.exp(-x))
    return tl.sqrt(tl.where(x > 20.0, x, _log1p(tl.exp(tl.minimum(x, 20.0)))))


@triton.jit
def _positive_grad(x, s, SCORE: tl.constexpr):
    """d score / d logit at the scores ``s`` of ``x``."""
    if SCORE == 1:
        return s * (1.0 - s)
    sig = 1.0 / (1.0 + tl.exp(-x))
    return sig / (2.0 * tl.maximum(s, 1e-30))


@triton.jit
def _top(values, candidate, e, K: tl.constexpr, E_PAD: tl.constexpr):
    """The mask of the K largest ``values`` among ``candidate`` (arg-max K times; ties to the lowest index)."""
    chosen = e < 0
    for _ in tl.static_range(K):
        free = candidate & ~chosen
        best = tl.max(tl.where(free, values, float("-inf")), axis=0)
        pick = tl.min(tl.where(free & (values == best), e, E_PAD), axis=0)
        chosen = chosen | (e == pick)
    return chosen


@triton.jit
def _group_allowed(sel, e, in_e, E, GROUPS: tl.constexpr, G_PAD: tl.constexpr, GROUP_TOPK: tl.constexpr,
                   PER_GROUP: tl.constexpr, E_PAD: tl.constexpr):
    """DeepSeek-V3's group limit: a group's score is the sum of its PER_GROUP best selection scores; the experts
    of the GROUP_TOPK best groups stay candidates."""
    g = tl.arange(0, G_PAD)
    member = ((e // (E // GROUPS))[None, :] == g[:, None]) & in_e[None, :] & (g < GROUPS)[:, None]  # [G, E]
    grid = tl.where(member, sel[None, :], float("-inf"))
    taken = member & (e[None, :] < 0)
    group_score = tl.zeros([G_PAD], tl.float32)
    for _ in tl.static_range(PER_GROUP):
        free = member & ~taken
        best = tl.max(tl.where(free, grid, float("-inf")), axis=1)
        pick = tl.min(tl.where(free & (grid == best[:, None]), e[None, :], E_PAD), axis=1)
        taken = taken | (e[None, :] == pick[:, None])
        group_score += best
    groups = _top(group_score, g < GROUPS, g, GROUP_TOPK, G_PAD)
    return tl.max(tl.where(member & groups[:, None], 1, 0), axis=0) > 0


@triton.jit
def _route_fwd_kernel(logits_ptr, bias_ptr, probs_ptr, map_ptr, E, scaling, K: tl.constexpr, SCORE: tl.constexpr,
                      PRE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, GROUPS: tl.constexpr,
                      G_PAD: tl.constexpr, GROUP_TOPK: tl.constexpr, E_PAD: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    in_e = e < E
    row = t.to(tl.int64) * E
    x = tl.load(logits_ptr + row + e, mask=in_e, other=float("-inf")).to(tl.float32)
    if SCORE == 0:
        if PRE:
            ex = tl.exp(x - tl.max(x, axis=0))
            s = ex / tl.sum(ex, axis=0)
            sel = s
        else:
            sel = x
    else:
        s = _positive(tl.where(in_e, x, 0.0), SCORE)
        sel = s
        if HAS_BIAS:
            sel = s + tl.load(bias_ptr + e, mask=in_e, other=0.0).to(tl.float32)
    sel = tl.where(in_e, sel, float("-inf"))
    candidate = in_e
    if GROUPS > 0:
        candidate = _group_allowed(sel, e, in_e, E, GROUPS, G_PAD, GROUP_TOPK, K // GROUP_TOPK, E_PAD)
    chosen = _top(sel, candidate, e, K, E_PAD)
    if SCORE == 0:
        if PRE:
            p = tl.where(chosen, s, 0.0)
        else:
            ex = tl.where(chosen, tl.exp(x - tl.max(tl.where(chosen, x, float("-inf")), axis=0)), 0.0)
            p = ex / tl.sum(ex, axis=0)
    else:
        p = tl.where(chosen, s, 0.0)
        if K > 1:
            p = p / (tl.sum(p, axis=0) + 1e-20)
    if HAS_SCALE:
        p = p * scaling
    tl.store(probs_ptr + row + e, p.to(probs_ptr.dtype.element_ty), mask=in_e)
    tl.store(map_ptr + row + e, chosen.to(tl.uint8), mask=in_e)


@triton.jit
def _route_bwd_kernel(logits_ptr, map_ptr, dprobs_ptr, dlogits_ptr, E, scaling, K: tl.constexpr,
                      SCORE: tl.constexpr, PRE: tl.constexpr, HAS_SCALE: tl.constexpr, E_PAD: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    in_e = e < E
    row = t.to(tl.int64) * E
    x = tl.load(logits_ptr + row + e, mask=in_e, other=float("-inf")).to(tl.float32)
    chosen = (tl.load(map_ptr + row + e, mask=in_e, other=0) != 0) & in_e
    g = tl.where(chosen, tl.load(dprobs_ptr + row + e, mask=in_e, other=0.0).to(tl.float32), 0.0)
    if HAS_SCALE:
        g = g * scaling
    if SCORE == 0:
        if PRE:
            ex = tl.exp(x - tl.max(x, axis=0))
            s = ex / tl.sum(ex, axis=0)
        else:
            ex = tl.where(chosen, tl.exp(x - tl.max(tl.where(chosen, x, float("-inf")), axis=0)), 0.0)
            s = ex / tl.sum(ex, axis=0)
        dx = s * (g - tl.sum(g * s, axis=0))
    else:
        xs = tl.where(in_e, x, 0.0)
        s = _positive(xs, SCORE)
        if K > 1:
            v = tl.where(chosen, s, 0.0)
            total = tl.sum(v, axis=0) + 1e-20
            dv = (g - tl.sum(g * v, axis=0) / total) / total
        else:
            dv = g
        dx = tl.where(chosen, dv * _positive_grad(xs, s, SCORE), 0.0)
    tl.store(dlogits_ptr + row + e, dx.to(dlogits_ptr.dtype.element_ty), mask=in_e)


@triton.jit
def _scores(x, in_e, SCORE: tl.constexpr):
    """The balancing losses' scores: softmax, or the positive scores normalised to sum to one."""
    if SCORE == 0:
        ex = tl.exp(x - tl.max(x, axis=0))
        return ex / tl.sum(ex, axis=0)
    s = tl.where(in_e, _positive(tl.where(in_e, x, 0.0), SCORE), 0.0)
    return s / (tl.sum(s, axis=0) + 1e-20)


@triton.jit
def _aux_fwd_kernel(logits_ptr, scores_ptr, map_ptr, E, K: tl.constexpr, SCORE: tl.constexpr, E_PAD: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    in_e = e < E
    row = t.to(tl.int64) * E
    x = tl.load(logits_ptr + row + e, mask=in_e, other=float("-inf")).to(tl.float32)
    s = _scores(x, in_e, SCORE)
    chosen = _top(tl.where(in_e, s, float("-inf")), in_e, e, K, E_PAD)
    tl.store(scores_ptr + row + e, s, mask=in_e)
    tl.store(map_ptr + row + e, chosen.to(tl.uint8), mask=in_e)


@triton.jit
def _aux_bwd_kernel(logits_ptr, dscores_ptr, dlogits_ptr, E, SCORE: tl.constexpr, E_PAD: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    in_e = e < E
    row = t.to(tl.int64) * E
    x = tl.load(logits_ptr + row + e, mask=in_e, other=float("-inf")).to(tl.float32)
    g = tl.load(dscores_ptr + row + e, mask=in_e, other=0.0).to(tl.float32)
    if SCORE == 0:
        s = _scores(x, in_e, SCORE)
        dx = s * (g - tl.sum(g * s, axis=0))
    else:
        xs = tl.where(in_e, x, 0.0)
        pos = tl.where(in_e, _positive(xs, SCORE), 0.0)
        total = tl.sum(pos, axis=0) + 1e-20
        dpos = (g - tl.sum(g * pos, axis=0) / total) / total
        dx = tl.where(in_e, dpos * _positive_grad(xs, pos, SCORE), 0.0)
    tl.store(dlogits_ptr + row + e, dx.to(dlogits_ptr.dtype.element_ty), mask=in_e)


SCORES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


def route_forward(logits, bias, probs, routing_map, topk, score, pre, scaling, groups, group_topk):
    tokens, experts = logits.shape
    _route_fwd_kernel[(tokens,)](logits, bias if bias is not None else logits, probs, routing_map, experts,
                                 float(scaling or 1.0), K=topk, SCORE=SCORES[score], PRE=bool(pre),
                                 HAS_BIAS=bias is not None, HAS_SCALE=bool(scaling), GROUPS=groups or 0,
                                 G_PAD=triton.next_power_of_2(max(groups or 1, 1)), GROUP_TOPK=group_topk or 1,
                                 E_PAD=triton.next_power_of_2(experts), num_warps=_warps(experts))


def route_backward(logits, routing_map, dprobs, dlogits, topk, score, pre, scaling):
    tokens, experts = logits.shape
    _route_bwd_kernel[(tokens,)](logits, routing_map, dprobs, dlogits, experts, float(scaling or 1.0), K=topk,
                                 SCORE=SCORES[score], PRE=bool(pre), HAS_SCALE=bool(scaling),
                                 E_PAD=triton.next_power_of_2(experts), num_warps=_warps(experts))


def aux_forward(logits, scores, routing_map, topk, score):
    tokens, experts = logits.shape
    _aux_fwd_kernel[(tokens,)](logits, scores, routing_map, experts, K=topk, SCORE=SCORES[score],
                               E_PAD=triton.next_power_of_2(experts), num_warps=_warps(experts))


def aux_backward(logits, dscores, dlogits, score):
    tokens, experts = logits.shape
    _aux_bwd_kernel[(tokens,)](logits, dscores, dlogits, experts, SCORE=SCORES[score],
                               E_PAD=triton.next_power_of_2(experts), num_warps=_warps(experts))


def _warps(experts: int) -> int:
    return 1 if experts <= 64 else 2 if experts <= 256 else 4
