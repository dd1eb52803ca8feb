"""Third-party warnings that need no action, kept off the console of `gspo-ray train`, each matched by category,
module (or logger) and message, so every other warning still shows.

- megatron-core, on a machine without Transformer Engine and Apex (every CPU machine): four UserWarnings "Transformer
  Engine and Apex are not installed. Falling back to ..." from its imports (megatron.core.optimizer,
  .optimizer.optimizer, .optimizer.clip_grads, megatron_fsdp.mixed_precision). The fallbacks are what runs on CPU;
  on GPU without them the same message is expected too (the project does not use TE's kernels).
- Ray's tensor deserialisation (ray._private.tensor_serialization_utils, RAY_ENABLE_ZERO_COPY_TORCH_TENSORS): torch's
  UserWarning "The given NumPy array is not writable" for tensors read zero-copy from the object store. The driver
  only reads them (weights refs, metrics).
- Ray's notice that a local cluster turned token authentication on by default ("Token authentication is enabled
  for this Ray cluster", logger ray._private.authentication.authentication_token_setup): the secure default, nothing
  to do. Its warning that authentication is *disabled* still shows.

    quiet_third_party()   # at the start of `gspo-ray train`, before megatron-core or Ray is imported
"""
from __future__ import annotations

import logging
import warnings

WARNINGS = (  # (message regex, category, module regex): warnings.filterwarnings("ignore", ...)
    (r"Transformer Engine and Apex are not installed", UserWarning, r"(megatron\.core|megatron_fsdp)(\..*)?$"),
    (r"The given NumPy array is not writable", UserWarning, r"ray\._private\.tensor_serialization_utils$"),
)
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


class _DropNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(RAY_AUTH_NOTICE)


def quiet_third_party() -> None:
    """Install the filters (idempotent)."""
    for message, category, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    logger = logging.getLogger(RAY_AUTH_LOGGER)
    if not any(isinstance(f, _DropNotice) for f in logger.filters):
        logger.addFilter(_DropNotice())
