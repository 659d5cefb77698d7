"""Reading a settings file a user wrote (a job spec, SLOs): bounded, UTF-8, safe YAML (JSON is YAML).

A hostile or mistaken file ends in one ``ConfigError`` line: too large, not text, not YAML,
or nested deeper than the parser can follow. Aliases are never expanded into copies
(``safe_load`` shares them), so a file of nested aliases costs no more than its size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rewind.infra.errors import ConfigError

MAX_BYTES = 1 << 20  # a settings file is a page or two; a larger one is something else


def read(path: Path, what: str) -> Any:
    """The parsed content of ``path``; ``what`` names the file in errors ("job spec", "SLO file")."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{what} {path} is larger than {MAX_BYTES >> 10} KiB")
    try:
        return yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is neither JSON nor YAML: {str(exc).splitlines()[0]}") from exc
    except RecursionError as exc:
        raise ConfigError(f"{what} {path} is nested too deeply") from exc
