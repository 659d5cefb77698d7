"""Keeping secrets out of what Rewind records: command lines and URLs, before they reach a manifest,
a catalog row, an incident or an off-site copy.

A flag whose name says it carries a secret (``--token=...``, ``--password X``,
``--api-key``...), an environment-style ``NAME=value`` whose name says so, and the
user:password part of a URL are replaced by ``<redacted>``. Secrets belong in the
environment or in files, never in flags; this is the net under that rule.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

HIDDEN = "<redacted>"
_SECRET_NAME = re.compile(
    r"token|passw|secret|api[-_]?key|access[-_]?key|private[-_]?key|auth|credential|cookie", re.I
)
_URL_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


def text(value: str) -> str:
    """``value`` with the user:password part of any URL in it hidden."""
    return _URL_USERINFO.sub(rf"\1{HIDDEN}@", value)


def argv(args: Sequence[str]) -> list[str]:
    """A command line with every secret-looking value hidden (the flags themselves stay, for the reader)."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next:
            out.append(HIDDEN)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        if _SECRET_NAME.search(name) and (arg.startswith("-") or (eq and name.replace("_", "").isalnum())):
            if eq:
                out.append(f"{name}={HIDDEN}")
            else:
                out.append(arg)
                hide_next = arg.startswith("-")
            continue
        out.append(text(arg))
    return out


# A name that is a secret itself (HF_TOKEN, WANDB_API_KEY, --db-password), not one that names where one is kept
# (--token-file, PASSWORD_PATH) nor one that merely contains such a word (--tokenizer, TOKENIZERS_PARALLELISM)
_SECRET_WORD = re.compile(
    r"(?:^|[-_])(?:token|password|passwd|secret|api[-_]?key|access[-_]?key|private[-_]?key|credentials?)$",
    re.I,
)
_URL_PASSWORD = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/@\s:]*:[^/@\s]+@")


def _secret_name(name: str) -> bool:
    return bool(_SECRET_WORD.search(name.lstrip("-")))


def in_plain_sight(command: Sequence[str], env: dict[str, str]) -> list[str]:
    """What in a job's command and environment is a secret given as a value (its name, never the value): a
    secret-named variable, a secret-named flag's value, a URL with a password. For parameters of a flow
    run, which the Prefect server keeps and shows as given."""
    found = [f"env {name}" for name, value in env.items() if value and _secret_name(name)]
    found += [
        f"env {name}: a URL with a password" for name, value in env.items() if _URL_PASSWORD.search(value)
    ]
    for i, arg in enumerate(command):
        name, eq, value = arg.partition("=")
        flag = arg.startswith("-")
        if flag and _secret_name(name) and (value if eq else i + 1 < len(command)):
            found.append(f"command flag {name}")
        elif _URL_PASSWORD.search(arg):
            found.append(f"command argument {i}: a URL with a password")
    return found
