"""What torchrun starts for a job Rewind launches: the job's own command, unchanged, by ``exec``.

torchrun parses every option-like argument after the script with its own parser,
abbreviations included, so a job flag such as ``--run`` (a prefix of torchrun's
``--run-path``) would be taken for torchrun's. Starting this module with ``--``
before the job's command keeps the command out of torchrun's parser; ``exec``
keeps the process torchrun watches, and its environment (RANK, LOCAL_RANK, ...).

    python -m torch.distributed.run <options> -m rewind.infra.launch.worker -- python -m pkg.train --run x
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    command = argv[1:] if argv[:1] == ["--"] else argv  # torchrun keeps the "--" to itself
    if not command:
        sys.exit("usage: python -m rewind.infra.launch.worker -- COMMAND [ARG ...]")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
