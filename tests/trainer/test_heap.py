"""trainer/heap.py: glibc keeps freed tensors' memory resident; release_free_heap gives it back (real allocator).

Run in a fresh interpreter: how much of a freed heap glibc keeps depends on what the process allocated before
(a test process that ran engines and jobs already holds free chunks the new tensors reuse)."""
from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json
import torch
from gspo_ray.trainer.heap import release_free_heap

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

release_free_heap()
before = rss_mib()
# 64 KiB each: below glibc's smallest mmap threshold (128 KiB), so they come from the heap
chunks = [torch.ones(2**14) for _ in range(4000)]  # 250 MiB, touched
fence = torch.ones(2**10)  # still alive above them, as a step's kept tensors are: the heap cannot shrink by itself
del chunks
kept = rss_mib() - before
trimmed = release_free_heap()
print(json.dumps({"kept": kept, "trimmed": trimmed, "after": rss_mib() - before, "fence": float(fence.sum())}))
"""


def test_freed_heap_goes_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["kept"] > 200, f"glibc returned the freed chunks by itself ({r['kept']:.0f} MiB kept): not needed"
    assert r["trimmed"] and r["after"] < 50, f"release_free_heap left {r['after']:.0f} MiB of freed chunks resident"
    assert r["fence"] == 2**10  # a live tensor keeps its memory
