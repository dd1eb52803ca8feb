"""The filter drops exactly vLLM's two tokenizer-less warnings, and they are still what vLLM writes (once the
installed vLLM no longer logs them, the source check fails and the filter can go)."""
import logging
from pathlib import Path

import vllm

from gspo_ray.rollout.vllm_quiet import EXPECTED, LOGGER, quiet_tokenizerless_engine


def test_the_messages_are_vllms_own():
    source = (Path(vllm.__file__).parent / "renderers" / "base.py").read_text()
    assert all(f'"{message}"' in source for message in EXPECTED)


def test_only_the_expected_warnings_are_dropped(caplog):
    quiet_tokenizerless_engine()
    quiet_tokenizerless_engine()  # idempotent
    logger = logging.getLogger(LOGGER)
    assert len(logger.filters) >= 1
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        logger.propagate, was = True, logger.propagate  # vLLM's own config stops propagation; caplog needs it
        try:
            logger.warning("Chat template warmup failed", exc_info=ValueError("skip_tokenizer_init=True"))
            logger.warning("Using None for EOS token id because tokenizer is not initialized")
            logger.warning("Chat template has an unknown field")
        finally:
            logger.propagate = was
    assert [r.getMessage() for r in caplog.records] == ["Chat template has an unknown field"]
