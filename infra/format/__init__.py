"""The checkpoint format, below every engine: digests, manifest, keyring, tensor files, the commit
protocol and verification. It knows nothing of the catalog, tiers or Prefect."""
