"""trainer/heap.py: glibc keeps freed tensors' memory resident; release_free_heap gives it back (real allocator)."""
from __future__ import annotations

import torch

from gspo_ray.trainer.heap import release_free_heap


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_freed_heap_goes_back_to_the_os():
    release_free_heap()
    before = _rss_mib()
    # 64 KiB each: below glibc's smallest mmap threshold (128 KiB), so from the heap whatever the process did before
    chunks = [torch.ones(2**14) for _ in range(4000)]  # 250 MiB, touched
    fence = torch.ones(2**10)  # still alive above them, as a step's kept tensors are: the heap cannot shrink
    del chunks
    kept = _rss_mib() - before
    assert kept > 200, f"glibc returned the freed chunks by itself ({kept:.0f} MiB kept): the trim is not needed"
    assert release_free_heap()
    assert _rss_mib() - before < 50, "release_free_heap left the freed chunks resident"
    assert float(fence.sum()) == 2**10  # a live tensor keeps its memory
