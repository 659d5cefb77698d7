"""A real S3 server on loopback for the tests: SeaweedFS (`weed mini`), started by ``rewind.infra.drills.servers``
(the drills start the same one)."""

from __future__ import annotations

from pathlib import Path

from rewind.infra.drills.servers import ACCESS_KEY, SECRET_KEY, SeaweedS3, weed_binary

BUCKET = "rewind"  # created by the ``s3`` fixture

__all__ = ["ACCESS_KEY", "BUCKET", "SECRET_KEY", "SeaweedS3", "big_checkpoint", "weed_binary"]


def big_checkpoint(run: str, root: Path, mb: int = 260):  # type: ignore[no-untyped-def]
    """A real multi-file checkpoint of ``mb`` MB (model + optimizer + rng + state.json)."""
    import torch

    from rewind.infra.catalog.db import Catalog
    from rewind.infra.checkpoint.engine import Checkpointer
    from rewind.infra.checkpoint.state import RNGState

    torch.manual_seed(0)
    n = mb * (1 << 20) // 4 // 3  # params + two Adam moments
    model = torch.nn.Linear(n // 1024, 1024, bias=False)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, n // 1024)).sum().backward()
    opt.step()
    ck = Checkpointer(
        run, states={"model": model, "optimizer": opt, "rng": RNGState()}, root=root, catalog=Catalog()
    )
    ck.save(1)
    return ck.last_saved
