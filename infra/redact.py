"""Keeping secrets out of what Rewind records: command lines and URLs, before they reach a manifest,
a catalog row, an incident or an off-site copy.

A flag whose name says it carries a secret (``--token=...``, ``--password X``,
``--api-key``...), an environment-style ``NAME=value`` whose name says so, and the
user:password part of a URL are replaced by ``<redacted>``. Secrets belong in the
environment or in files, never in flags; this is the net under that rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

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


# A name that is a secret itself (HF_TOKEN, WANDB_API_KEY, PGPASSWORD, --db-password, wandb.api_key=), not one that
# names where one is kept (--token-file, PASSWORD_PATH), a tokenizer's token (--eos-token, --pad_token), a switch
# (--use_auth_token) nor one that merely contains such a word (--tokenizer, --max-new-tokens, TOKENIZERS_PARALLELISM)
_SECRET_WORD = re.compile(
    r"(?:^|[-_]|pg)(?:token|password|passwd|secret|api[-_]?key|access[-_]?key|private[-_]?key)$", re.I
)
_NOT_SECRET = re.compile(r"(?:eos|bos|pad|unk|sep|cls|mask|special|implicit|auth)[-_]token$", re.I)
_NO_SECRET_VALUE = re.compile(
    r"(?:true|false|yes|no|none|null|on|off|[0-9]+|[~./].*)", re.I
)  # a switch, a path
_OVERRIDE = re.compile(r"\+*[A-Za-z_][\w.-]*")  # a Hydra-style ``a.b.c=value`` argument
_URL_PASSWORD = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/@\s:]*:[^/@\s]+@")


def _secret(name: str, value: str) -> bool:
    """Whether ``name=value`` gives a secret as its value (not a switch, a count or a path to a file)."""
    bare = name.lstrip("-+").rpartition(".")[2]
    if not value or _NO_SECRET_VALUE.fullmatch(value) or _NOT_SECRET.search(bare):
        return False
    return bool(_SECRET_WORD.search(bare))


def in_plain_sight(command: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """What in a job's command and environment is a secret given as a value (its name, never the value): a
    secret-named variable, flag or ``a.b=`` override whose value is no switch, count or path; a URL with a
    password. For parameters of a flow run, which the Prefect server keeps and shows as given."""
    found = [f"env {name}" for name, value in env.items() if _secret(name, value)]
    found += [
        f"env {name}: a URL with a password" for name, value in env.items() if _URL_PASSWORD.search(value)
    ]
    for i, arg in enumerate(command):
        name, eq, value = arg.partition("=")
        flag = arg.startswith("-")
        if flag and not eq and i + 1 < len(command) and not command[i + 1].startswith("-"):
            value = command[i + 1]
        if (flag or (eq and _OVERRIDE.fullmatch(name))) and _secret(name, value):
            found.append(f"command {'flag' if flag else 'argument'} {name}")
        elif _URL_PASSWORD.search(arg):
            found.append(f"command argument {i}: a URL with a password")
    return found
