"""What counts as a secret in a job's inputs, and how it is blanked before anything leaves the job (the config copy
in the run directory, the W&B run config, the run lock's command line, the logged `submit` entrypoint).

    redact_args(["gspo-ray", "train", "x.yaml", "cluster.runtime_env.env_vars.HF_TOKEN=hf_abc"])
    # -> [..., "cluster.runtime_env.env_vars.HF_TOKEN=<redacted>"]
"""
from __future__ import annotations

import re
from typing import Sequence

REDACTED = "<redacted>"
# A key names a secret when one of its words (split on non-alphanumerics and camelCase) is one of these, or it
# contains one of the fragments: HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, openaiApiKey, db_password,
# Authorization, OPENAI_API are redacted; max_tokens, TOKENIZERS_PARALLELISM, OMP_NUM_THREADS are not.
SECRET_WORDS = {"token", "key", "secret", "password", "passwd", "pwd", "auth", "authorization", "credential",
                "credentials", "cookie", "private", "signature", "apikey", "pat", "dsn", "api"}
SECRET_FRAGMENTS = ("secret", "passw", "credential", "apikey", "privatekey", "accesskey")
URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


def is_secret_key(key: str) -> bool:
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key).lower()
    parts = set(re.split(r"[^a-z0-9]+", words))
    squashed = re.sub(r"[^a-z0-9]", "", key.lower())
    return bool(parts & SECRET_WORDS) or any(f in squashed for f in SECRET_FRAGMENTS)


def redact_url(text: str) -> str:
    """The user:password part of every URL in `text` replaced."""
    return URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)


def redact_args(args: Sequence[str]) -> list[str]:
    """A command line with the values of secret-looking keys blanked: `a.b.HF_TOKEN=...` and `--api-key=...`
    overrides, `--token VALUE` pairs, and URL credentials anywhere."""
    out: list[str] = []
    secret_next = False
    for arg in args:
        if secret_next:
            out.append(REDACTED)
            secret_next = False
            continue
        key, eq, _ = arg.partition("=")
        if eq and any(is_secret_key(part) for part in re.split(r"[.\[\]]", key.lstrip("-")) if part):
            out.append(f"{key}={REDACTED}")
            continue
        if arg.startswith("-") and not eq and is_secret_key(arg.lstrip("-")):
            secret_next = True  # `--token VALUE`
        out.append(redact_url(arg))
    return out
