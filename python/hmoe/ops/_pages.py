"""The page-table entries a batch of requests uses (host tensors): shared by mla_decode's index
check and the flashinfer adapter's page list."""
from __future__ import annotations


def used_pages(torch, page_table, seq_lens, page_size: int):
    """(pages used per request, [B, max_pages] mask of the used entries)."""
    used = (seq_lens + page_size - 1) // page_size
    return used, torch.arange(page_table.shape[1])[None, :] < used[:, None]


def bad_entry(page_table, mask, num_pages: int) -> tuple[int, int] | None:
    """(b, j) of the first used entry outside [0, num_pages), or None."""
    bad = mask & ((page_table < 0) | (page_table >= num_pages))
    return tuple(bad.nonzero()[0].tolist()) if bool(bad.any()) else None
