"""`rewind status [RUN] [--json]`: the catalog's overview (rewind.infra.catalog.overview), printed for people."""

from __future__ import annotations

import argparse
from typing import Any

from rewind.flows.cli_args import Add, Emit, OpenCatalog, Wrap


def cmd_status(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.catalog import overview, overview_text

    cat = catalog()
    got = overview.status(cat, args.run)
    emit(args, got, lambda: overview_text.text(got, catalog=cat.safe_url))
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
