"""`rewind status [RUN] [--json]`: the catalog's overview (infra.catalog.overview), printed for people."""

from __future__ import annotations

import argparse
from typing import Any

from flows.cli_args import Add, Emit, OpenCatalog, Wrap


def cmd_status(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from infra.catalog import overview, overview_text

    got = overview.status(catalog(), args.run)
    emit(args, got, lambda: overview_text.text(got))
    return 0


def register(
    sub: Any,
    add: Add,
    wrap: Wrap,
) -> None:
    st = add(
        sub,
        "status",
        wrap(cmd_status),
        "per run: newest verified checkpoint, what dying now would cost, copies per tier and their lag, "
        "open incidents; per model: versions, weights and their checkpoints",
        json_flag=True,
    )
    st.add_argument("run", nargs="?", help="only this run (and the models serving it)")
