"""`gspo-ray train` keeps third-party warnings that need no action off the console (cli/quiet.py): the real
megatron-core imports, Ray's zero-copy tensor deserialisation and Ray's token-auth notice, in a fresh process each
(a warning is printed once per place). The same message from anywhere else, and Ray's auth-*disabled* warning, show."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, sys, warnings
if sys.argv[1] == "quiet":
    from gspo_ray.cli.quiet import quiet_third_party
    quiet_third_party()
import megatron.core.optimizer  # noqa: F401  (three of the Transformer Engine / Apex warnings)
import numpy as np
# what ray.get does with a tensor read zero-copy from the object store (a read-only buffer)
from ray._private.tensor_serialization_utils import _zero_copy_tensors_deserializer
a = np.zeros(8, dtype=np.uint8)
a.setflags(write=False)
_zero_copy_tensors_deserializer(a, "torch.uint8", (8,), "cpu")
warnings.warn("Transformer Engine and Apex are not installed (from elsewhere)")  # not megatron's: shown
logging.basicConfig()
auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
auth.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
auth.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
"""


def _stderr(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_third_party_notices_are_filtered_and_nothing_else():
    # without the filters (`_stderr("loud")`, 2026-12-03): three Transformer Engine / Apex warnings from the
    # import, the NumPy one and both auth lines; one process here, the megatron-core import is ~10 s
    quiet = _stderr("quiet")
    assert quiet.count("Transformer Engine and Apex are not installed") == 1  # only the one from elsewhere
    assert "(from elsewhere)" in quiet
    assert "NumPy array is not writable" not in quiet and "Token authentication is enabled" not in quiet
    assert "Token authentication is disabled" in quiet  # a warning that asks for action stays
