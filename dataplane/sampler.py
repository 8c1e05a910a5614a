"""The sampler: greedy, temperature, top-k, top-p and min-p, with per-request seeds.

Two paths, each an exact draw from softmax(logits / T):

- fused (kernels.sample; on CUDA by default; the data plane's
  tuning, NANOPLANE_FUSED_SAMPLER=0|1, chooses): two short
  Triton passes over the raw logits, Gumbel-max a group of columns at a time, for every row without
  top-k/top-p/min-p (under tensor parallelism every rank scans its slice of the vocabulary:
  ModelRunner._sample_slices). A row's noise is a function
  of its key and offset: a seeded request's are its seed and the position of the token it draws,
  so its tokens depend neither on the batch nor on a preemption (a recomputed request draws each
  position again with the same noise); unseeded rows take the shared seed and a draw counter.
- torch (the CPU path, and the rows with filters): softmax, one exponential noise E per vocabulary
  entry, argmax(p / E). A seeded row's noise comes from a generator seeded afresh with a mix of its
  seed and the position of the token it draws, so, as on the fused path, its tokens depend neither
  on the batch, nor on how its prompt was chunked or found in the prefix cache (mid-prompt chunks
  draw and discard a token), nor on a preemption.

A request keeps its filters for life, so it stays on one path, and its seeded draws stay
reproducible whatever shares its batch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import numpy as np
import torch


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, fused: bool | None = None):
        """`fused`: use the Triton kernel for rows without filters; by default on CUDA when triton is
        installed; True on a CPU runs the kernel in Triton's interpreter (tests)."""
        self.device = device
        self.shared = torch.Generator(device=device)
        self.shared.manual_seed(seed)
        if fused is None:
            fused = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self.fused = fused
        # The fused path's key for unseeded rows: the shared seed with the top bit set, outside the
        # [0, 2**63) of request seeds, so the shared stream never replays a seeded request's noise.
        self.shared_key = seed % 2**63 - 2**63
        self.draws = 0  # unseeded rows drawn by the fused path: each takes the next offset
        # The torch path's seeded rows: reseeded per row and draw (draw_seed), reused so that a step
        # creates no generators.
        self.row_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, seeds: list[int | None] | None = None, all_greedy: bool | None = None,
                 filtered: bool | None = None, positions: list[int] | np.ndarray | None = None) -> torch.Tensor:
        """logits [R, V]; parameters [R] on logits' device; returns [R] int64 token ids.

        `seeds`: per row a request's seed or None; `positions` [R], the position of the token each
        row draws, must be given when a row is seeded (both paths key its noise by them).
        `all_greedy` and `filtered` may be given by a caller that knows them from host copies of the
        parameters; otherwise the torch path reads them from the device (a sync). The fused path
        reads the parameters back to the host (a sync); rank 0 calls `sample` with host copies.
        """
        rows = logits.shape[0]
        seeds = np.array([-1 if s is None else s for s in ([None] * rows if seeds is None else seeds)],
                         dtype=np.int64)
        if positions is None:
            if (seeds >= 0).any():
                raise ValueError("seeded rows need the positions of the tokens they draw")
            positions = np.zeros(rows, dtype=np.int64)
        if not self.fused:
            return self._torch_sample(logits, temperature, top_k, top_p, min_p, seeds, np.asarray(positions),
                                      all_greedy, filtered)
        host = [x.cpu().numpy() for x in (temperature, top_k, top_p, min_p)]
        return self.sample(logits, *host, seeds, np.asarray(positions))

    def sample(self, logits: torch.Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               min_p: np.ndarray, seeds: np.ndarray, positions: np.ndarray,
               upload: Callable[..., list[torch.Tensor]] | None = None) -> torch.Tensor:
        """Token ids [R] (int64, on logits' device) from raw logits [R, V] and host arrays [R].

        temperature/top_k/top_p/min_p: float32/int32/float32/float32 as BatchState keeps them;
        seeds: each request's seed, -1 for none; positions: the position of the token each row
        draws (the tokens its request holds). `upload` copies host arrays to the device in one go
        (rank 0 passes its Uploader); nothing here waits for the device.
        """
        upload = upload or self._upload
        if not temperature.any():
            return logits.argmax(dim=-1)
        row_filtered = filtered_rows(top_k, top_p, min_p)
        if not self.fused or row_filtered.all():
            t, k, p, m = upload(temperature, top_k, top_p, min_p)
            return self._torch_sample(logits, t, k, p, m, seeds, positions, all_greedy=False,
                                      filtered=bool(row_filtered.any()))
        from nanoplane import kernels  # triton is optional: only the fused path needs it

        keys, offsets = self.streams(seeds, positions)
        if not row_filtered.any():
            t, keys_t, offsets_t = upload(temperature, keys, offsets)
            return kernels.sample(logits, t, keys_t, offsets_t)
        # Some rows filter: the kernel draws every row (cheaper than gathering the others), then the
        # torch path redraws the filtered rows, each as it would in any batch.
        rows = np.flatnonzero(row_filtered)
        t, keys_t, offsets_t, rows_t, k, p, m = upload(temperature, keys, offsets, rows.astype(np.int64),
                                                       top_k[rows], top_p[rows], min_p[rows])
        out = kernels.sample(logits, t, keys_t, offsets_t)
        out[rows_t] = self._torch_sample(logits[rows_t], t[rows_t], k, p, m, seeds[rows], positions[rows],
                                         all_greedy=not temperature[rows].any(), filtered=True)
        return out

    def advance(self, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> None:
        """Move the draw counter as `sample` would over these rows, without drawing: a tensor-parallel
        rank that leaves a whole-row draw to rank 0 keeps its unseeded stream in step with rank 0's."""
        if self.fused and temperature.any() and not filtered_rows(top_k, top_p, min_p).all():
            self.draws += len(temperature)

    def streams(self, seeds: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The fused path's (key, offset) per row, int64: (seed, position) for a seeded row, (the
        shared key, the next draw number) for the others."""
        n = len(seeds)
        seeded = seeds >= 0
        keys = np.where(seeded, seeds, self.shared_key).astype(np.int64)
        offsets = np.where(seeded, positions, np.arange(self.draws, self.draws + n)).astype(np.int64)
        self.draws += n
        return keys, offsets

    def warmup(self, vocab_size: int, max_rows: int, dtype: torch.dtype, whole: bool = True,
               vocab_slice: tuple[int, int] | None = None) -> None:
        """Compile the fused kernel's variants (tile size, split or not) for every batch size now, not
        during the first steps that meet them; with triton's disk cache this is quick after the first run.
        `whole`: for whole rows (kernels.sample); `vocab_slice`: (start, width) for a tensor-parallel
        rank's slice (kernels.sample_partial)."""
        if not self.fused or self.device.type != "cuda":
            return
        from nanoplane import kernels

        t = torch.ones(max_rows, device=self.device)
        zeros = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        # Logits of the runtime's row strides: Triton specializes a kernel on them.
        rows_of = torch.zeros(max_rows, vocab_size, dtype=dtype, device=self.device) if whole else None
        slices = torch.zeros(max_rows, vocab_slice[1], dtype=dtype, device=self.device) if vocab_slice else None
        for rows in range(1, max_rows + 1):
            if rows_of is not None:
                kernels.sample(rows_of[:rows], t[:rows], zeros[:rows], zeros[:rows])
            if slices is not None:
                kernels.sample_partial(slices[:rows], vocab_slice[0], vocab_size, t[:rows], zeros[:rows], zeros[:rows])
        torch.cuda.synchronize(self.device)

    def _upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        return [torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in arrays]

    def _torch_sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, min_p: torch.Tensor, seeds: np.ndarray, positions: np.ndarray,
                      all_greedy: bool | None, filtered: bool | None) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if all_greedy if all_greedy is not None else bool((temperature == 0).all()):
            return greedy
        logits = logits / torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
        if filtered is None or filtered:
            logits = apply_filters(logits, top_k, top_p, min_p)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.shared)
        for i in np.flatnonzero(seeds >= 0).tolist():  # a seeded row's noise: its seed and position alone
            self.row_generator.manual_seed(draw_seed(int(seeds[i]), int(positions[i])))
            noise[i].exponential_(generator=self.row_generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperature == 0, greedy, sampled)


def draw_seed(seed: int, position: int) -> int:
    """The torch path's generator seed for a seeded request's draw at `position`: splitmix64 of the
    pair, so that neighbouring seeds or positions give unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def filtered_rows(top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """Which rows use top-k, top-p or min-p (host arrays as BatchState keeps them): those take the torch path."""
    return (top_k > 0) | (top_p < 1) | (min_p > 0)


def apply_filters(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit that top-k, top-p or min-p removes (each 0/1/0 disables it per row)."""
    if bool((top_k <= 0).all()) and bool((top_p >= 1).all()) and bool((min_p <= 0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    # top-p over what top-k left: keep a token while the mass before it is below top_p, so the most
    # likely token always stays.
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
