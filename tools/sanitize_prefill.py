"""A few hmoe.ops.ragged_prefill calls (and, for the portable family, paged_prefill) of one variant,
small enough to run under compute-sanitizer: a ragged batch with empty requests, one key, partial
tiles and more queries' keys than one tile, fewer queries than keys, causal and not, GQA, every
head-dim pair, bf16 and fp16, lse; paged_prefill at page sizes 4, 16 and 64 with a bad page id. Every
output is checked for NaN/inf (a sanitizer run checks the memory accesses; tests/ops/test_ragged_prefill.py
and test_paged_prefill.py check the values).

    compute-sanitizer --tool racecheck python3 tools/sanitize_prefill.py sm90a
    (also --tool memcheck, --tool synccheck; the variant: portable or sm90a, default sm90a)
"""
from __future__ import annotations

import sys

import torch

from hmoe.ops import paged_prefill, ragged_prefill

# (query lengths, key lengths) per request: empty requests, a single key, partial and whole tiles
LENGTHS = (([0, 1, 7, 130, 0, 200], [0, 1, 7, 130, 5, 333]), ([257], [257]))
DIMS = ((192, 128), (128, 128), (64, 64))
# paged_prefill's page sizes: pages too small for the TMA (cp.async), pages that make a tile (on sm_90
# and newer the TMA at 192 x 128, a box a page and block; cp.async at the other head dims) and pages of
# whole 64-key tiles (the TMA, a box a tile)
PAGES = (4, 16, 64)


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)


def main(variant: str) -> int:
    torch.manual_seed(0)
    bad = 0
    for dtype in (torch.bfloat16, torch.float16):
        for dqk, dv in DIMS:
            for (lq, lk), heads, kv_heads, causal in ((LENGTHS[0], 8, 2, True), (LENGTHS[1], 4, 4, False)):
                q = torch.randn(sum(lq), heads, dqk, device="cuda", dtype=dtype)
                k = torch.randn(sum(lk), kv_heads, dqk, device="cuda", dtype=dtype)
                v = torch.randn(sum(lk), kv_heads, dv, device="cuda", dtype=dtype)
                out, lse = ragged_prefill(q, k, v, _indptr(lq), _indptr(lk), causal=causal, sm_scale=dqk**-0.5,
                                          return_lse=True, variant=variant)
                torch.cuda.synchronize()
                finite = bool(torch.isfinite(out).all())
                bad += not finite
                print(f"{variant} ragged {dtype} {dqk}x{dv} H={heads}/{kv_heads} lq={lq} lk={lk} causal={causal}: "
                      f"{'ok' if finite else 'NOT FINITE'}")
                if variant != "portable":  # paged_prefill is the portable family's only
                    continue
                for page in PAGES:
                    max_pages = (max(lk) + page - 1) // page + 1
                    pages = len(lk) * max_pages + 2
                    k_cache = torch.randn(pages, page, kv_heads, dqk, device="cuda", dtype=dtype)
                    v_cache = torch.randn(pages, page, kv_heads, dv, device="cuda", dtype=dtype)
                    table = torch.randperm(pages, device="cuda", dtype=torch.int32)[: len(lk) * max_pages]
                    table[1] = pages + 5  # a bad page id in a used entry (request 0's second page): zeros
                    kv_lens = torch.tensor(lk, device="cuda", dtype=torch.int32)
                    out = paged_prefill(q, k_cache, v_cache, table.view(len(lk), max_pages), kv_lens, _indptr(lq),
                                        causal=causal, sm_scale=dqk**-0.5, variant=variant)
                    torch.cuda.synchronize()
                    finite = bool(torch.isfinite(out).all())
                    bad += not finite
                    print(f"{variant} paged {dtype} {dqk}x{dv} page={page}: {'ok' if finite else 'NOT FINITE'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "sm90a"))
