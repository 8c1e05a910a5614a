"""The sampling tail's per-row kernels: the token bitmask, the penalties, and the logprob statistics.

Each works in place on (or reads) chosen rows of a step's logits [R, V], so rows without
processors or logprobs are never touched:

- `apply_bitmask`: -inf on every token whose bit is clear in the row's packed mask (bit j of
  word w allows token 32 w + j; tokens past the mask's width are not allowed);
- `apply_penalties`: HuggingFace's repetition penalty over the tokens seen in the prompt or the
  output, then OpenAI's frequency and presence penalties over the output counts, one read and
  one write of each row, in fp32;
- `logprob_stats`: each row's log-sum-exp and the logprob and rank (1 + tokens strictly more
  likely) of one target token, one read of each row (top-N comes from torch.topk).

kernels.reference holds their fp32 torch twins.
"""

import torch
import triton
import triton.language as tl

_BLOCK = 2048  # columns a program handles per step of its loop


@triton.jit
def _bitmask_kernel(logits_ptr, rows_ptr, mask_ptr, stride_row, V, W, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i).to(tl.int64)
    word = cols // 32
    bits = tl.load(mask_ptr + i.to(tl.int64) * W + word, mask=(cols < V) & (word < W), other=0)
    allowed = ((bits >> (cols % 32)) & 1) != 0
    ptr = logits_ptr + row * stride_row + cols
    x = tl.load(ptr, mask=cols < V)
    tl.store(ptr, tl.where(allowed, x, float("-inf")).to(x.dtype), mask=cols < V)


@triton.jit
def _penalties_kernel(logits_ptr, rows_ptr, state_rows_ptr, counts_ptr, seen_ptr, rep_ptr, freq_ptr, pres_ptr,
                      stride_row, V, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < V
    row = tl.load(rows_ptr + i).to(tl.int64)
    state = tl.load(state_rows_ptr + i).to(tl.int64)
    rep = tl.load(rep_ptr + i)
    freq = tl.load(freq_ptr + i)
    pres = tl.load(pres_ptr + i)
    ptr = logits_ptr + row * stride_row + cols
    raw = tl.load(ptr, mask=live)
    x = raw.to(tl.float32)
    count = tl.load(counts_ptr + state * V + cols, mask=live, other=0)
    seen = (tl.load(seen_ptr + state * V + cols, mask=live, other=0) != 0) | (count > 0)
    x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    x = x - freq * count.to(tl.float32) - tl.where(count > 0, pres, 0.0)
    tl.store(ptr, x.to(raw.dtype), mask=live)


@triton.jit
def _stats_kernel(logits_ptr, rows_ptr, targets_ptr, lse_ptr, target_lp_ptr, rank_ptr, stride_row, V,
                  BLOCK: tl.constexpr):
    """Program i: row rows[i]'s max and sum of exp (online, fp32) and the count of columns above the target."""
    i = tl.program_id(0)
    row_ptr = logits_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_row
    target = tl.load(targets_ptr + i)
    t = tl.load(row_ptr + target).to(tl.float32)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    above = tl.zeros((BLOCK,), tl.int32)
    for c0 in range(0, V, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x == x, x, float("-inf"))  # NaN counts as impossible
        new_m = tl.maximum(m, x)
        # A lane still at -inf shifts by 0 instead (-inf - -inf would be NaN): its sum stays 0.
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = new_m
        above += (x > t).to(tl.int32)
    top = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), 0)
    lse = top + tl.log(total)
    tl.store(lse_ptr + i, lse)
    tl.store(target_lp_ptr + i, t - lse)
    tl.store(rank_ptr + i, 1 + tl.sum(above, 0))


def _grid_cols(v: int) -> int:
    return triton.cdiv(v, _BLOCK)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] (int32 [M, W]) is clear."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2 and bitmask.is_contiguous()
    if rows.numel() == 0:
        return
    _bitmask_kernel[(rows.numel(), _grid_cols(logits.shape[1]))](
        logits, rows, bitmask, logits.stride(0), logits.shape[1], bitmask.shape[1], BLOCK=_BLOCK)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, state_rows: torch.Tensor, counts: torch.Tensor,
                    seen: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> None:
    """In place on logits[rows[i]]: the repetition penalty where the token is in seen[state_rows[i]]
    (the prompt, uint8) or counts[state_rows[i]] > 0 (the output, int32), then frequency times the
    count and presence where the count is positive subtracted. Parameters fp32 [P]."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    v = logits.shape[1]
    assert counts.dtype == torch.int32 and seen.dtype == torch.uint8 and counts.shape[1] == seen.shape[1] == v
    if rows.numel() == 0:
        return
    _penalties_kernel[(rows.numel(), _grid_cols(v))](
        logits, rows, state_rows, counts, seen, repetition, frequency, presence, logits.stride(0), v, BLOCK=_BLOCK)


def logprob_stats(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For row rows[i] of logits: (log-sum-exp fp32 [L], the logprob of token targets[i] fp32 [L],
    its rank int32 [L]: 1 + the tokens with a strictly larger logit)."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    n = rows.numel()
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    target_lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    rank = torch.empty(n, dtype=torch.int32, device=logits.device)
    if n:
        # One program a row reads it whole: wide tiles keep a lone row's loop short (37 steps at Qwen3's vocabulary).
        _stats_kernel[(n,)](logits, rows, targets, lse, target_lp, rank, logits.stride(0), logits.shape[1],
                            BLOCK=4096 if logits.is_cuda else 512, num_warps=8)
    return lse, target_lp, rank
