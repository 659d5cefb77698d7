"""The one restore path: plan (a pure read of the catalog), then execute (verify, fetch, load, record).

Every caller uses it: the single-process and sharded checkpointers, the restore and
recovery tasks, `rewind ckpt restore`, replication (for its source) and serving export.
"""
