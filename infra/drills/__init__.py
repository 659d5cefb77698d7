"""Recovery drills: Chaos Toolkit experiments against a real job, judged against SLOs (no Prefect here)."""
