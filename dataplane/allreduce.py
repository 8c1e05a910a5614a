"""A one-shot all-reduce through peer GPU memory, for the small sums of decode steps.

Each decoder layer sums its row-parallel outputs over the ranks twice. At decode sizes (a few MB at
most) NCCL's ring steps cost far more than the bytes, a large share of a decode step's GPU time under
tensor parallelism. A one-shot all-reduce instead puts
every rank's input where every rank can reach it (buffers in torch symmetric memory, which each GPU
addresses over NVLink), meets the other ranks at a device-side barrier and has each rank add all the
parts itself: one kernel, no ring steps, capturable in a CUDA graph. Larger tensors (prefill) stay
with NCCL.

Two kernels: `NANOPLANE_ALLREDUCE=triton`, the default, is kernels/one_shot_all_reduce.py (a program
per SM, NVLink writes, one meet a call); `symm_mem` is torch's (at most 24 blocks, reads the peers
and meets them twice); `nccl` turns both off. When the buffers cannot be set up on
every rank, every rank uses NCCL (set_up_everywhere); a rank that dies inside the rendezvous itself
leaves its peer waiting there, which the control plane's start timeout and heartbeats end.
Neither uses NVLink multicast (the multimem operations): torch's reads peers with plain loads, the
Triton one writes them with plain stores. The
Triton one also offers `add_rms_norm`: the sum, the residual add and the RMSNorm that follows a
row-parallel layer in one kernel (models/layers/layernorm.py calls it through parallel.py).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from nanoplane.settings import Tuning

log = logging.getLogger(__name__)

# The one-shot kernel beats NCCL on small tensors only (`python -m benchmarks.allreduce` finds the
# crossover); decode sums are at most max_num_seqs x hidden x 2 bytes (2 MiB for Qwen3-8B at 256 rows).
DEFAULT_MAX_BYTES = 2 << 20
# The process group of this process's first symmetric-memory rendezvous (SymmMemAllReduce.__init__
# says why a later group may not have one).
_first_group: list[dist.ProcessGroup | None] = [None]


class SymmMemAllReduce:
    """Sums tensors of up to `max_bytes` in one kernel over peer memory; returns None for the rest."""

    name = "symm_mem"  # its NANOPLANE_ALLREDUCE value

    def __init__(self, device: torch.device, dtype: torch.dtype, max_bytes: int = DEFAULT_MAX_BYTES,
                 group: dist.ProcessGroup | None = None, meet: bool = True):
        """`meet=False` allocates only; `meet()` then exchanges the buffers with the other ranks."""
        group = group or dist.group.WORLD
        if _first_group[0] is not None and _first_group[0] is not group:
            # A second engine in one process (tests), on a new process group of the same name, hangs on
            # its first request; several buffers on one group work. NCCL is the safe answer for that case.
            raise RuntimeError("symmetric memory was set up in this process before, for another process group")
        # The one-shot kernel needs no multicast object; make sure none is created (on shared hosts
        # multicast can take the GPUs out of service).
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group
        self.group_name = group.group_name
        self.dtype = dtype
        self.capacity = max_bytes // torch.empty(0, dtype=dtype).element_size()  # elements a call takes
        self.buffer = symm_mem.empty(self.slots(dist.get_world_size(group)) * self.capacity, dtype=dtype,
                                     device=device)
        if meet:
            self.meet()

    def slots(self, world_size: int) -> int:
        """Inputs of up to max_bytes that the buffer holds at once."""
        return 1

    def meet(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.rendezvous(self.buffer, self.group_name)
        self.op = torch.ops.symm_mem.one_shot_all_reduce_copy_out

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x fits the buffer: this dtype, at most its size, contiguous, on the GPU."""
        return x.dtype == self.dtype and x.numel() <= self.capacity and x.is_contiguous() and x.is_cuda

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.takes(x):
            return None
        n = x.numel()
        out = torch.empty_like(x)
        # Copies x into this rank's buffer, waits for every rank's copy, sums all the buffers into out.
        self.op(self.buffer[:n], x.view(-1), "sum", self.group_name, out.view(-1))
        return out


class TritonOneShotAllReduce(SymmMemAllReduce):
    """Buffers summed by kernels/one_shot_all_reduce.py: 128 programs store x into the peers' buffers
    (torch's kernel reads the peers with at most 24 blocks), a slot for each rank's part, in two sets
    that alternate from call to call (so it meets the peers once a call, not twice)."""

    name = "triton"

    def slots(self, world_size: int) -> int:
        return 2 * world_size

    def meet(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from nanoplane.kernels.one_shot_all_reduce import Peers, max_programs

        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        device, programs = self.buffer.device, max_programs(self.buffer.device)
        if handle.signal_pad_size < programs * handle.world_size * 4:
            raise RuntimeError(f"symmetric-memory signal pad of {handle.signal_pad_size} bytes, "
                               f"{programs * handle.world_size * 4} needed")
        # Each rank's buffer starts at the same offset inside its allocation as ours does.
        offset = self.buffer.data_ptr() - handle.buffer_ptrs[handle.rank]
        addresses = [p + offset for p in handle.buffer_ptrs]
        if any(a % 16 for a in addresses):  # the kernel moves 16 bytes at a time to and from them
            raise RuntimeError(f"symmetric buffers not 16-byte aligned: {[hex(a) for a in addresses]}")
        self.peers = Peers(buffers=torch.tensor(addresses, dtype=torch.int64, device=device),
                           pads=torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device),
                           phase=torch.zeros(programs, dtype=torch.int32, device=device),
                           slot_bytes=self.capacity * self.buffer.element_size(),
                           rank=handle.rank, world_size=handle.world_size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        from nanoplane.kernels.one_shot_all_reduce import one_shot_all_reduce

        if not self.takes(x):
            return None
        return one_shot_all_reduce(x, torch.empty_like(x), self.peers)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The RMSNorm that follows a row-parallel layer, with its residual add and the layer's sum
        over the ranks in one kernel: (normed, new residual), or None for a tensor it does not take."""
        from nanoplane.kernels.one_shot_all_reduce import one_shot_all_reduce_rms_norm

        if not self.takes(x) or x.dim() != 2 or not residual.is_contiguous() or residual.dtype != x.dtype:
            return None
        return one_shot_all_reduce_rms_norm(x, residual, weight, eps, self.peers)


CHOICES = {"symm_mem": SymmMemAllReduce, "triton": TritonOneShotAllReduce}


def make_fast_all_reduce(device: torch.device, dtype: torch.dtype, world_size: int,
                         choice: str = Tuning.allreduce) -> SymmMemAllReduce | None:
    """The all-reduce `choice` names (the data plane's tuning, NANOPLANE_ALLREDUCE): None (NCCL) for
    'nccl', for a run that is not tensor-parallel on CUDA, or where symmetric memory cannot be set up
    on every rank."""
    if choice != "nccl" and choice not in CHOICES:
        raise ValueError(f"all-reduce {choice!r}: expected 'nccl', " + " or ".join(repr(c) for c in CHOICES))
    if choice == "nccl" or world_size < 2 or device.type != "cuda":
        return None
    return set_up_everywhere(lambda: CHOICES[choice](device, dtype, meet=False), device)


def set_up_everywhere(make, device: torch.device):
    """`make()` then `.meet()` on every rank, or None on every rank if either failed on any (a
    collective). The ranks agree after each phase: a rank that could not allocate must not leave its
    peers in the rendezvous, and one summing over peer memory while another waits in NCCL would hang."""
    fast, error = None, ""
    try:
        fast = make()
    except (RuntimeError, AttributeError, ImportError) as e:
        error = str(e)
    if _everywhere(fast is not None, device):
        try:
            fast.meet()
        except (RuntimeError, ImportError) as e:  # ImportError: the Triton kernel without triton
            fast, error = None, str(e)
        if _everywhere(fast is not None, device):
            if _first_group[0] is None and hasattr(fast, "group"):
                _first_group[0] = fast.group
            return fast
    log.warning("symmetric-memory all-reduce unavailable on some rank (%s); using NCCL", error or "see its log")
    return None


def _everywhere(ok: bool, device: torch.device) -> bool:
    """Whether `ok` holds on every rank (a collective: every rank must call it)."""
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
