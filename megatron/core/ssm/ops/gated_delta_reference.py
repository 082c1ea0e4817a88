"""The gated delta rule (Gated DeltaNet, Qwen3-Next) in eager PyTorch: a chunked form with the WY
representation (runs anywhere, autograd through it) and the step-by-step recurrence (tests only).

Per head, state S [dk, dv], log decay g_t <= 0, write strength beta_t in (0, 1):
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,     o_t = S_t^T (scale q_t)
Shapes are batch-first as fla takes them: q, k [b, l, h, dk], v [b, l, h, dv], g, beta [b, l, h];
states [b, h, dk, dv]. q and k arrive already L2-normalised (the mixer does it).
"""
import torch
import torch.nn.functional as F


def chunk_gated_delta_rule_torch(q, k, v, g, beta, scale=None, chunk_size: int = 64, initial_state=None,
                                 output_final_state: bool = False, **unused):
    """Chunked gated delta rule in fp32. Inside a chunk the writes u solve a unit lower-triangular system
    (I + A) u = beta (v - exp(G) K S_0), with A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) for j < i and G
    the in-chunk cumulative log decay; the state then moves chunk to chunk. Returns (o, final state or None)."""
    dtype = q.dtype
    b, l, h, dk = k.shape
    dv = v.size(-1)
    scale = dk ** -0.5 if scale is None else scale
    pad = (-l) % chunk_size
    # [b, l, h, d] -> [b, h, l, d] in fp32; padding has g = 0 and beta = 0: it neither decays nor writes.
    q, k, v = (F.pad(t.float().transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t.float().transpose(1, 2), (0, pad)) for t in (g, beta))
    nc = (l + pad) // chunk_size
    q, k, v = (t.reshape(b, h, nc, chunk_size, -1) for t in (q, k, v))
    g, beta = (t.reshape(b, h, nc, chunk_size) for t in (g, beta))
    q = q * scale
    G = g.cumsum(-1)  # [b, h, c, L]
    L = chunk_size
    strict = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(0)  # j >= i: outside the strict lower part
    upper = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
    gdiff = G[..., :, None] - G[..., None, :]
    decay_strict = gdiff.masked_fill(strict, float("-inf")).exp()
    decay_causal = gdiff.masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2)) * decay_strict
    eye = torch.eye(L, dtype=A.dtype, device=A.device)
    T_rhs = torch.cat([v * beta[..., None], k_beta * G.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(eye + A, T_rhs, upper=False, unitriangular=True)
    u_free, w = solved[..., :dv], solved[..., dv:]  # u = u_free - w @ S_0
    qk = (q @ k.transpose(-1, -2)) * decay_causal  # [b, h, c, L, L]
    state = (torch.zeros(b, h, dk, dv, dtype=torch.float32, device=q.device)
             if initial_state is None else initial_state.float())
    out = []
    for c in range(nc):
        u = u_free[:, :, c] - w[:, :, c] @ state
        out.append((q[:, :, c] * G[:, :, c, :, None].exp()) @ state + qk[:, :, c] @ u)
        g_last = G[:, :, c, -1, None]  # [b, h, 1]
        k_to_end = k[:, :, c] * (g_last - G[:, :, c]).exp()[..., None]
        state = state * g_last.exp()[..., None] + k_to_end.transpose(-1, -2) @ u
    o = torch.stack(out, dim=2).reshape(b, h, nc * L, dv)[:, :, :l].transpose(1, 2).to(dtype)
    return o, (state if output_final_state else None)


def recurrent_gated_delta_rule_reference(q, k, v, g, beta, scale=None, initial_state=None):
    """The recurrence one token at a time, in the dtype it is given (tests pass fp64). Returns (o, state)."""
    b, l, h, dk = k.shape
    scale = dk ** -0.5 if scale is None else scale
    state = (torch.zeros(b, h, dk, v.size(-1), dtype=q.dtype, device=q.device)
             if initial_state is None else initial_state.to(q.dtype))
    out = []
    for t in range(l):
        state = state * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, kt)) * beta[:, t, :, None]
        state = state + kt[..., None] * delta[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * scale))
    return torch.stack(out, dim=1), state
