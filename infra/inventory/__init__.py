"""The catalog against storage: rebuild it from the manifests on a tier, check the two agree, adopt."""
