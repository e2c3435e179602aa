"""A few hmoe.ops.mla_decode calls of one variant, small enough to run under compute-sanitizer:
partial last tiles, lengths 0, 1 and page boundaries, several tiles, KV splits (and on sm90a a batch
whose two splits merge in the kernel, a cluster of two CTAs), 8, 16, 24, 64 and 128 heads (sm90a serves
8 and 24 with padded tile rows; it leaves the 16-head call, a small one, to the portable family), page
sizes 16, 32 and 64, bf16 and fp16, lse. Every output is checked
for NaN/inf (a sanitizer run checks the memory accesses; tests/ops/test_mla_decode.py checks the
values).

    compute-sanitizer --tool racecheck python3 tools/sanitize_mla.py sm90a
    (also --tool memcheck, --tool synccheck; the variant: portable or sm90a, default sm90a)
"""
from __future__ import annotations

import sys

import torch

from hmoe.ops import mla, mla_decode

# (batch, heads, sequence lengths, page size)
CASES = ((2, 128, [1, 200], 64), (1, 64, [4100], 64), (3, 128, [0, 64, 130], 16), (2, 16, [33, 2047], 32),
         (2, 24, [500, 3000], 64), (3, 8, [0, 9000, 65], 64))


def main(variant: str) -> int:
    torch.manual_seed(0)
    bad = 0
    pair = torch.cuda.get_device_properties(0).multi_processor_count // 4  # 128 heads: two splits
    cases = CASES + ((pair, 128, [[0, 1, 40, 300, 1000][i % 5] for i in range(pair)], 64),)
    for dtype in (torch.bfloat16, torch.float16):
        for B, H, lens, page in cases:
            max_pages = (max(lens) + page - 1) // page + 1
            pages = B * max_pages + 2
            ckv = torch.randn(pages, page, 512, device="cuda", dtype=dtype)
            kpe = torch.randn(pages, page, 64, device="cuda", dtype=dtype)
            table = torch.randperm(pages, device="cuda", dtype=torch.int32)[: B * max_pages].view(B, max_pages)
            seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
            q_nope = torch.randn(B, H, 512, device="cuda", dtype=dtype)
            q_pe = torch.randn(B, H, 64, device="cuda", dtype=dtype)
            try:
                out, lse = mla_decode(q_nope, q_pe, ckv, kpe, table.contiguous(), seq_lens, sm_scale=0.07,
                                      return_lse=True, variant=variant)
            except ValueError as e:  # a shape the forced family declines
                print(f"{variant} {dtype} B={B} H={H} lens={lens} page={page}: declined ({e})")
                continue
            torch.cuda.synchronize()
            finite = bool(torch.isfinite(out).all())
            bad += not finite
            plan = mla.plan(0, B, H, max_pages, page, variant=variant).describe()
            print(f"{variant} {dtype} B={B} H={H} lens={lens} page={page} ({plan}): {'ok' if finite else 'NOT FINITE'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "sm90a"))
