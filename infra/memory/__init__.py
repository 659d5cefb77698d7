"""The memory tier: a node's newest committed checkpoints held in shared memory (tmpfs), out of the job's
processes, so that a process crash restores without reading storage (docs/design.md, 2.2)."""
