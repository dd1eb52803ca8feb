"""Suite-wide settings. `dtype: auto` (the tiny recipe's) resolves to float32 on every host here, so the suite does
not change with the CPU it runs on (gspo_ray/models/native_bf16.py); subprocesses inherit it."""
import os

os.environ.setdefault("GSPO_RAY_AUTO_DTYPE", "float32")
