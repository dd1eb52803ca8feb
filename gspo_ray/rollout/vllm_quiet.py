"""Two vLLM 0.32 warnings that are expected with an engine built without a tokenizer, dropped at their logger.

The engine takes token ids and returns token ids (`skip_tokenizer_init=True`, rollout/engine.py), so vLLM's
renderer (`vllm.renderers.base`) cannot warm up a chat template ("Chat template warmup failed" with a traceback)
and reports no EOS/BOS id ("Using None for EOS token id because tokenizer is not initialized"). Neither matters:
nothing is rendered by vLLM, and EOS still stops completions (the model's generation config gives its id). A
filter on that one logger drops exactly these messages; every other vLLM warning still shows.
"""
from __future__ import annotations

import logging

LOGGER = "vllm.renderers.base"
EXPECTED = ("Chat template warmup failed",
            "Using None for EOS token id because tokenizer is not initialized",
            "Using None for BOS token id because tokenizer is not initialized")


class ExpectedWithoutTokenizer(logging.Filter):
    """Drops the records whose message starts with one of EXPECTED."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(EXPECTED)


def quiet_tokenizerless_engine() -> None:
    """Install the filter on vLLM's renderer logger (once; before or after vLLM is imported)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, ExpectedWithoutTokenizer) for f in logger.filters):
        logger.addFilter(ExpectedWithoutTokenizer())
