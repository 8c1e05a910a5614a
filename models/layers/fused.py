"""Whether layers use the fused Triton kernels (RMSNorm with the residual add, rotary in place).

Off by default: plain torch is the reference and the CPU path. The data plane turns it on with a
GPU backend, where the fused kernels replace about ten small launches each.
"""

from __future__ import annotations

_ENABLED = False


def enable_fused_kernels(enabled: bool) -> None:
    global _ENABLED
    _ENABLED = enabled


def fused_kernels_enabled() -> bool:
    return _ENABLED
