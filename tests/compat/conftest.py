"""The compat tests share the trainer tests' tiny models and their multi-rank helper (`_spawn`)."""
from __future__ import annotations

import sys
from pathlib import Path

_TRAINER = Path(__file__).resolve().parents[1] / "trainer"
for _root in (_TRAINER, _TRAINER.parents[1]):
    if str(_root) not in sys.path:
        sys.path.append(str(_root))

from tests.trainer.conftest import tiny_llama_dir, tiny_moe_dir, tiny_qwen2_dir  # noqa: E402,F401  (fixtures)
