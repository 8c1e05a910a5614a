"""The attention kernels and the K/V store against their fp32 torch references (kernels/reference.py):
paged decode (split-KV, row orders, launch alternatives) and paged prefill (cached prefixes, chunks).

Without CUDA the kernels run in Triton's interpreter at tiny shapes; the real shapes are in the
`gpu`-marked cases at the end. The other kernels: tests/kernels/test_layer_kernels.py.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads (see tests/kernels/test_layer_kernels.py)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

from support.kernel_checks import DEV, DTYPES, HEADS, TOL, gpu, i32, paged_cache, rel_err  # noqa: E402

import nanoplane.kernels.decode_attention as decode_module  # noqa: E402
import nanoplane.kernels.prefill_attention as prefill_attention  # noqa: E402
from nanoplane.kernels import paged_decode_attention, paged_prefill_attention, store_kvcache  # noqa: E402
from nanoplane.kernels import reference as ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("seed_from_test_id")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page,hkv,d,slot_dtype", [(16, 3, 64, torch.int32), (256, 2, 128, torch.int64),
                                                   (32, 1, 80, torch.int64)])
def test_store_kvcache(dtype, page, hkv, d, slot_dtype):
    n, num_blocks = 13, 3
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype, device=DEV)
    v_cache = k_cache.clone()
    # Key and value as strided views of one fused buffer, as the QKV projection produces them.
    fused = torch.randn(n, 2 * hkv + 1, d, device=DEV).to(dtype)
    key, value = fused[:, :hkv], fused[:, hkv : 2 * hkv]
    slots = torch.randperm(num_blocks * page, device=DEV)[:n].to(slot_dtype)
    slots[[0, 5, n - 1]] = -1
    store_kvcache(key, value, k_cache, v_cache, slots)
    keep = slots >= 0
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert torch.equal(flat_k[slots[keep]], key[keep]) and torch.equal(flat_v[slots[keep]], value[keep])
    untouched = torch.ones(num_blocks * page, dtype=torch.bool, device=DEV)
    untouched[slots[keep]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("page,ctx_lens,num_splits", [
    (16, [1, 37, 0, 130, 65], None),
    (32, [200, 1, 63], 3),
    (256, [0, 300, 7], 2),
    (64, [129, 5], 1),
])
def test_decode(dtype, hq, hkv, d, page, ctx_lens, num_splits, monkeypatch):
    k_cache, v_cache, tables = paged_cache(ctx_lens, page, hkv, d, dtype)
    q = torch.randn(len(ctx_lens), hq + 2, d, device=DEV).to(dtype)[:, 1 : hq + 1]  # strided view
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    poisoned = lambda shape, device: torch.full(shape, float("nan"), device=device)
    monkeypatch.setattr(decode_module, "_workspace", poisoned)
    scale = d**-0.5
    paged_decode_attention(q, k_cache, v_cache, tables, i32(ctx_lens), scale, out=out, num_splits=num_splits)
    expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, i32(ctx_lens), scale)
    assert rel_err(out, expected) < TOL[dtype]
    for b, n in enumerate(ctx_lens):
        if n == 0:
            assert (out[b] == 0).all()


@pytest.mark.parametrize("heads_fastest", [True, False])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_seq_order(heads_fastest, num_splits):
    """Rows handed to programs in a given order (longest context first, or any permutation) land in
    their own output rows; the result does not depend on the order."""
    ctx_lens = [5, 300, 0, 64, 129, 1]
    k_cache, v_cache, tables = paged_cache(ctx_lens, 16, 2, 64, torch.float32)
    q = torch.randn(len(ctx_lens), 4, 64, device=DEV)
    lens = i32(ctx_lens)
    expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    for order in (torch.argsort(lens, descending=True, stable=True).int(), i32([2, 0, 5, 1, 4, 3])):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out=out, num_splits=num_splits,
                               seq_order=order, tuning=dict(heads_fastest=heads_fastest))
        assert rel_err(out, expected) < TOL[torch.float32]
        assert (out[2] == 0).all()


def test_longest_first():
    from nanoplane.dataplane.cuda_graphs import longest_first

    order = longest_first(np.array([3, 9, 0, 9, 4], dtype=np.int32))
    assert order.dtype == np.int32 and order.tolist() == [1, 3, 4, 0, 2]  # ties keep row order


@pytest.mark.parametrize("tuning", [dict(heads_fastest=False), dict(block_n=32, heads_fastest=True),
                                    dict(block_n=128, num_warps=8, num_stages=3)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_launch_alternatives(tuning, num_splits):
    """The benchmark's sweep alternatives (grid order, tile) compute the same attention."""
    ctx_lens = [70, 0, 300, 1]
    k_cache, v_cache, tables = paged_cache(ctx_lens, 16, 4, 64, torch.float32)
    q = torch.randn(len(ctx_lens), 8, 64, device=DEV)
    out = paged_decode_attention(q, k_cache, v_cache, tables, i32(ctx_lens), 0.125, num_splits=num_splits,
                                 tuning=tuning)
    expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, i32(ctx_lens), 0.125)
    assert rel_err(out, expected) < TOL[torch.float32]
    assert (out[1] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("page,q_lens,ctx_lens", [
    (16, [37, 1, 70], [37, 1, 70]),  # plain prefill, odd lengths
    (32, [5, 0, 33, 1], [69, 3, 33, 17]),  # cached prefixes, an empty chunk, a decode-like row
    (256, [20, 9], [300, 9]),
])
def test_prefill(dtype, hq, hkv, d, page, q_lens, ctx_lens):
    k_cache, v_cache, tables = paged_cache(ctx_lens, page, hkv, d, dtype)
    cu = i32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    q = torch.randn(sum(q_lens), hq, d + 16, device=DEV).to(dtype)[..., :d]  # strided view
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    scale = d**-0.5
    args = (cu, i32(ctx_lens), tables, max(q_lens) + 3, scale)  # max_seqlen_q is an upper bound
    paged_prefill_attention(q, k_cache, v_cache, *args, out=out)
    expected = ref.paged_prefill_attention_ref(q, k_cache, v_cache, *args)
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("page", [16, 128])  # key tiles across pages, and inside one page
@pytest.mark.parametrize("tuning", [prefill_attention.TUNING, prefill_attention.LONG_TUNING,
                                    dict(block_m=128, block_n=32, num_warps=8, num_stages=2),
                                    dict(block_m=64, block_n=64, num_warps=4, num_stages=2)])
def test_prefill_launch_alternatives(tuning, page):
    """The sweep's tiles (short and long prompts' included) compute the same attention: tiles wider
    than a sequence, a diagonal inside one key tile, a prefix ending mid-tile."""
    q_lens, ctx_lens = [37, 1, 130], [37, 200, 300]
    k_cache, v_cache, tables = paged_cache(ctx_lens, page, 4, 64, torch.float32)
    cu = i32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    q = torch.randn(sum(q_lens), 8, 64, device=DEV)
    args = (cu, i32(ctx_lens), tables, max(q_lens), 0.125)
    out = paged_prefill_attention(q, k_cache, v_cache, *args, tuning=tuning)
    assert rel_err(out, ref.paged_prefill_attention_ref(q, k_cache, v_cache, *args)) < TOL[torch.float32]


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128)])
def test_chunked_prefill_matches_one_shot(hq, hkv, d):
    """Store + attend chunk by chunk through the cache == causal attention over the whole prompt."""
    page, length, chunks = 16, 90, [40, 1, 31, 18]
    k_cache, v_cache, tables = paged_cache([length], page, hkv, d, torch.float32)
    q, k, v = (torch.randn(length, h, d, device=DEV) for h in (hq, hkv, hkv))
    pos = torch.arange(length, device=DEV)
    slots = tables[0, pos // page].long() * page + pos % page
    outs, done = [], 0
    for c in chunks:
        store_kvcache(k[done : done + c], v[done : done + c], k_cache, v_cache, slots[done : done + c])
        done += c
        outs.append(paged_prefill_attention(q[done - c : done], k_cache, v_cache, i32([0, c]), i32([done]),
                                            tables, c, d**-0.5))
    expected = ref.causal_attention(q, k, v, pos, d**-0.5)
    assert rel_err(torch.cat(outs), expected) < TOL[torch.float32]







@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_ctx,page", [(256, 1024, 16), (256, 1024, 256), (2, 32768, 16)])
def test_decode_gpu(batch, max_ctx, page):
    hq, hkv, d, dtype = 16, 8, 128, torch.bfloat16
    ctx_lens = torch.randint(1, max_ctx + 1, (batch,)).tolist()
    ctx_lens[0] = max_ctx
    k_cache, v_cache, tables = paged_cache(ctx_lens, page, hkv, d, dtype)
    q = torch.randn(batch, hq, d, device=DEV, dtype=dtype)
    out = paged_decode_attention(q, k_cache, v_cache, tables, i32(ctx_lens), d**-0.5)
    expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, i32(ctx_lens), d**-0.5)
    assert rel_err(out, expected) < TOL[dtype]
    # Longest context first, followed from the threshold's batch sizes up (256 rows are past it).
    order = torch.argsort(i32(ctx_lens), descending=True, stable=True).int()
    ordered = paged_decode_attention(q, k_cache, v_cache, tables, i32(ctx_lens), d**-0.5, seq_order=order)
    assert torch.equal(ordered, out)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 256])  # the GPU's default KV block is 256 tokens
@pytest.mark.parametrize("q_lens,ctx_lens,hq,dtype", [
    ([4096], [4096], 16, torch.bfloat16),  # long-prompt tiles (LONG_TUNING)
    ([1000, 1, 2048, 1047], [1500, 700, 2048, 3000], 16, torch.bfloat16),
    ([1000, 1, 2048, 1047], [1500, 700, 2048, 3000], 32, torch.bfloat16),  # GQA 4, Qwen3-8B's heads
    ([2048, 300], [2048, 3000], 16, torch.float32),  # long, but fp32 keeps the short tiles' shared memory
    ([100, 1023, 1, 517], [100, 1500, 900, 517], 16, torch.bfloat16),  # short prompts (TUNING)
])
def test_prefill_gpu(q_lens, ctx_lens, hq, dtype, page):
    hkv, d = 8, 128
    k_cache, v_cache, tables = paged_cache(ctx_lens, page, hkv, d, dtype)
    cu = i32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=dtype)
    args = (cu, i32(ctx_lens), tables, max(q_lens), d**-0.5)
    out = paged_prefill_attention(q, k_cache, v_cache, *args)
    assert rel_err(out, ref.paged_prefill_attention_ref(q, k_cache, v_cache, *args)) < TOL[dtype]
