"""A LocalCluster dies with the process that started it, even when that process is killed before its teardown
runs (a test stopped by a timeout): its nodes get SIGTERM from the kernel when their parent dies."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OWNER = """
import sys, time
sys.path.insert(0, {root!r})
from cluster.local_cluster import LocalCluster
c = LocalCluster(num_worker_nodes=0, base_dir={base!r})
c.start()
print(c.nodes[0].proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split()[2] == "Z"


@pytest.mark.slow
def test_nodes_stop_when_their_owner_is_killed(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER.format(root=str(ROOT), base=str(tmp_path))],
                             stdout=subprocess.PIPE, text=True)
    head = int(owner.stdout.readline())
    assert _alive(head)
    owner.send_signal(signal.SIGKILL)  # no finalizer, no stop(): only the kernel's parent-death signal is left
    owner.wait()
    deadline = time.monotonic() + 60
    while _alive(head) and time.monotonic() < deadline:
        time.sleep(0.5)
    alive = _alive(head)
    if alive:  # do not leak it into the rest of the suite
        os.killpg(head, signal.SIGKILL)
    assert not alive, "the head node outlived the process that started it"
