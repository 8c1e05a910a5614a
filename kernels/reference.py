"""Plain-torch fp32 references for every kernel in this package.

Written for clarity, not speed: loops over sequences, explicit gathers through the block tables.
Tests compare the Triton ops against these; they also document the exact semantics.
"""

import torch


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached rows ([length, H_kv, D], fp32) of one sequence."""
    page_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    pages = block_table[pos // page_size].long()
    return cache[pages, pos % page_size].float()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float):
    """q [Lq, Hq, D] at absolute positions q_pos; k, v [Lk, Hkv, D] at positions 0..Lk-1."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    causal = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], n)
        v = gather_kv(v_cache, block_tables[b], n)
        pos = torch.tensor([n - 1], device=q.device)
        out[b] = causal_attention(q[b : b + 1], k, v, pos, scale)[0]
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b, n in enumerate(context_lens.tolist()):
        q_len = cu[b + 1] - cu[b]
        assert q_len <= max_seqlen_q and q_len <= n
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], n)
        v = gather_kv(v_cache, block_tables[b], n)
        pos = torch.arange(n - q_len, n, device=q.device)
        out[cu[b] : cu[b + 1]] = causal_attention(q[cu[b] : cu[b + 1]], k, v, pos, scale)
    return out


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF Llama/Qwen3 RMSNorm, operation for operation (so bf16 results match HF bit-for-bit).

    The residual add happens in the input dtype, as in HF's decoder layer (`residual + hidden`),
    and the weight multiplies *after* the cast back to the input dtype.
    """
    dtype = x.dtype
    if residual is not None:
        x = x + residual
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    out = (weight * hidden.to(dtype)).to(dtype)
    return out if residual is None else (out, x)


def apply_rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (rotate halves) in fp32; returns new tensors in the input dtype.

    cos_sin_cache[p] = cat(cos, sin), each of width rot_dim / 2; the first rot_dim dims of every
    head are rotated and the rest pass through.
    """
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = cos.shape[-1]
        x1, x2, rest = x[..., :half].float(), x[..., half : 2 * half].float(), x[..., 2 * half :]
        y = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((y, rest), dim=-1)

    return rotate(q), rotate(k)


def row_scale_ref(y: torch.Tensor, rows: torch.Tensor, eps: float) -> torch.Tensor:
    """y [T, N] times 1 / rms of each row of `rows` [T, H], rounded to y's dtype: an RMSNorm whose
    weight the linear layer before it holds, applied to that layer's output (models/norm_fold.py)."""
    inv_rms = torch.rsqrt(rows.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y.float() * inv_rms).to(y.dtype)


def qkv_prologue_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    row_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """The unfused chain the fused prologue replaces: split the QKV output into heads, per-head
    RMSNorm of q and k (when weights are given), rotary, then the cache store. Returns a new q.
    `row_norm` (rows, eps): the output first scaled by row_scale_ref."""
    if row_norm is not None:
        qkv = row_scale_ref(qkv, *row_norm)
    head_dim = k_cache.shape[-1]
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(-1, num_q_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    q, k = apply_rotary_ref(q, k, positions, cos_sin_cache)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def silu_and_mul_ref(x: torch.Tensor, row_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """silu(gate) * up as torch computes it in x's dtype (silu rounded, then the product); with
    `row_norm` (rows, eps), x first scaled by row_scale_ref."""
    if row_norm is not None:
        x = row_scale_ref(x, *row_norm)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def group_draw_scores(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor,
                      cuts: tuple[int, ...] = (), group: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scores of kernels.sampling's two-level Gumbel-max draw, in fp64, with the uniforms given
    ([R, 2V]: u[:, c] column c's, u[:, V + c] the group's starting at c).

    Groups: runs of `group` columns from multiples of `group`, also cut at `cuts` (where vocabulary
    slices start). Returns (group of each column [V], each group's score [R, G]: T * logsumexp(x / T)
    plus T times its Gumbel noise, or its max at T == 0; each column's score [R, V]: x plus T times
    its noise, or x). NaN logits count as -inf.
    """
    x = logits.double()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    rows, vocab = x.shape
    t = temperature.double().unsqueeze(1)
    starts = sorted(set(range(0, vocab, group)) | {c for c in cuts if 0 < c < vocab})
    gid = torch.bucketize(torch.arange(vocab, device=x.device),
                          torch.tensor(starts, device=x.device), right=True) - 1
    index = gid.expand(rows, vocab)
    m = torch.full((rows, len(starts)), float("-inf"), dtype=x.dtype, device=x.device)
    m = m.scatter_reduce(1, index, x, "amax")
    mc = m.gather(1, index)
    # x == max covers the infinities (x - max would be NaN): such a column counts 1.
    e = torch.where(x == mc, 1.0, torch.exp((x - mc) / torch.where(t > 0, t, 1.0)))
    s = torch.zeros_like(m).index_add_(1, gid, e)
    g = -torch.log(-torch.log(uniforms.double()))
    group_noise = g[:, vocab + torch.tensor(starts, device=x.device)]
    group_scores = torch.where(t > 0, m + t * (torch.log(s) + group_noise), m)
    column_scores = torch.where(t > 0, x + t * g[:, :vocab], x)
    return gid, group_scores, column_scores


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor,
                     cuts: tuple[int, ...] = (), group: int = 64) -> torch.Tensor:
    """kernels.sampling's draw in fp64 with the uniforms given: int64 [R] token ids.

    Rows at T > 0: the group with the best score (group_draw_scores), then within it the column
    with the best score; this is an exact draw from softmax(logits / T) because Gumbel noise is
    max-stable. Rows at T == 0 take argmax(logits). Ties go to the lowest index;
    kernels.sampling.sampling_uniforms gives the u that kernels.sampling.sample draws.
    """
    gid, group_scores, column_scores = group_draw_scores(logits, temperature, uniforms, cuts, group)
    chosen = group_scores.argmax(dim=1, keepdim=True)
    inside = torch.where(gid.unsqueeze(0) == chosen, column_scores, float("-inf"))
    return inside.argmax(dim=1)


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in fp32: x [M, K] @ weight[N, K]^T (+ bias[N]) -> fp32 [M, N] (TF32 must be off, torch's default)."""
    y = x.float() @ weight.float().T
    return y + bias.float() if bias is not None else y


def apply_bitmask_ref(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf on logits[rows[i], t] unless bit t % 32 of bitmask[i, t // 32] is set (rows distinct)."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    words = cols // 32
    inside = words < bitmask.shape[1]
    bits = torch.zeros(rows.shape[0], logits.shape[1], dtype=torch.int64, device=logits.device)
    bits[:, inside] = (bitmask.long()[:, words[inside]] >> (cols[inside] % 32)) & 1
    rows = rows.long()
    logits[rows] = logits[rows].masked_fill(bits == 0, float("-inf"))


def apply_penalties_ref(logits: torch.Tensor, rows: torch.Tensor, state_rows: torch.Tensor, counts: torch.Tensor,
                        seen: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                        presence: torch.Tensor) -> None:
    """In place, fp32: HuggingFace's repetition penalty over prompt (seen) and output (counts > 0)
    tokens, then OpenAI's frequency (times the count) and presence (count > 0) penalties (rows distinct)."""
    rows, state_rows = rows.long(), state_rows.long()
    x = logits[rows].float()
    count = counts[state_rows].float()
    hit = (seen[state_rows] != 0) | (count > 0)
    rep = repetition[:, None]
    x = torch.where(hit, torch.where(x > 0, x / rep, x * rep), x)
    x = x - frequency[:, None] * count - presence[:, None] * (count > 0).float()
    logits[rows] = x.to(logits.dtype)


def logprob_stats_ref(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp, the target's logprob, its rank: 1 + tokens strictly more likely) of rows of logits, fp32."""
    x = logits[rows.long()].float()
    lse = torch.logsumexp(x, dim=-1)
    t = x.gather(1, targets.long()[:, None])[:, 0]
    return lse, t - lse, (1 + (x > t[:, None]).sum(dim=-1)).to(torch.int32)
