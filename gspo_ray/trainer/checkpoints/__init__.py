"""Trainer checkpoints: what each rank writes, how another layout reads it back, and why a file can be trusted.

    checkpoint.py   rank files + meta.json (written last), save / load of a rank's payload
    shards.py       who writes which bytes, and resharding on load (any DP / TP / EP layout, either layer spec)
    durable.py      fsync'd writes and the manifest (size, sha256) that says a checkpoint is intact (no torch)
    safe_paths.py   paths read from a shared checkpoint volume are followed only inside it (no torch)
"""
