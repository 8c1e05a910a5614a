"""Triton kernels of the data plane. Each op has an fp32 torch twin in kernels.reference.

triton is an optional dependency (the `gpu` extra): without it `import kernels` and
`kernels.reference` still work and the ops raise ImportError when used. On a CPU the kernels run
in Triton's interpreter: TRITON_INTERPRET=1 must be set before triton is first imported, since
@triton.jit (on our kernels and on triton.language's own helpers) chooses at import time.
"""

import importlib.util

__all__ = [
    "apply_bitmask",
    "apply_penalties",
    "apply_rotary",
    "combine_partials",
    "logprob_stats",
    "paged_decode_attention",
    "paged_prefill_attention",
    "qkv_prologue",
    "rms_norm",
    "sample",
    "sample_partial",
    "silu_and_mul",
    "skinny_gemm",
    "store_kvcache",
]

if importlib.util.find_spec("triton") is not None:
    from nanoplane.kernels.activation import silu_and_mul
    from nanoplane.kernels.decode_attention import paged_decode_attention
    from nanoplane.kernels.logits_processors import apply_bitmask, apply_penalties, logprob_stats
    from nanoplane.kernels.prefill_attention import paged_prefill_attention
    from nanoplane.kernels.qkv_prologue import qkv_prologue
    from nanoplane.kernels.rmsnorm import rms_norm
    from nanoplane.kernels.rotary import apply_rotary
    from nanoplane.kernels.sampling import combine_partials, sample, sample_partial
    from nanoplane.kernels.skinny_gemm import skinny_gemm
    from nanoplane.kernels.store_kvcache import store_kvcache
else:

    def __getattr__(name: str):
        if name in __all__:
            raise ImportError(f"kernels.{name} needs triton (pip install 'nanoplane[gpu]')")
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
