# Rewind: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; a range in pyproject.toml lets users keep their own build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test test-e2e test-heavy test-host-drills lint bench drills clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

demo: install
	$(BIN)/python -m rewind.examples.demo

test: install
	$(BIN)/python -m pytest -q

# The heavier end-to-end set (tests/conftest.py's E2E, listed in docs/testing.md: the serving and
# storage-failover drills, prefect deploy with a worker, the elastic shrink relaunches, a host lost on the
# Slurm lab, the docs' walk-through, more recoveries and reshardings) that `make test` skips, saying so;
# about 20 minutes on 2 cores. Not run by CI.
test-e2e: install
	REWIND_TEST_E2E=1 $(BIN)/python -m pytest -q -m e2e --timeout 1500

# The long series of the kill tests (40 SIGKILLs at random moments, five rounds of kills inside
# background saves, gc SIGKILLed at 20 random deletion steps) that `make test` runs short (6 kills,
# one round, 4 gc kills), and the progress test on a 2.2 GB checkpoint (300 MB in `make test`);
# not run by CI.
test-heavy: install
	REWIND_TEST_KILLS=40 REWIND_TEST_GC_KILLS=20 REWIND_TEST_PROGRESS_MB=2200 \
		$(BIN)/python -m pytest -q -n 2 --timeout 1500 \
		tests/test_resume.py tests/test_async_save.py tests/test_progress.py tests/test_gc_kill.py

# The host-loss and network-isolation drills against the Slurm lab (tests/slurm_lab.py; root, Debian's
# slurmctld slurmd slurm-client munge), each end to end, and the lab's host-lost, rendezvous-host-lost
# and network-isolation faults (host-lost is in `make test-e2e` too): about 9 minutes in all.
test-host-drills: install
	REWIND_TEST_HOST_DRILLS=1 REWIND_TEST_E2E=1 REWIND_REQUIRE_SLURM=1 $(BIN)/python -m pytest -q -n 0 --timeout 1800 \
		tests/test_slurm.py -k "host_drill or lost_host"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Every drill scenario against the example job, recorded in the catalog, then the HTML report.
drills: install
	$(BIN)/rewind drill run --all --report drills-report.html

bench: install
	$(BIN)/python -m bench.run
	$(BIN)/python -m bench.s3
	$(BIN)/python -m bench.session
	$(BIN)/python -m bench.incremental --params-m 50 --checkpoints 20
	$(BIN)/python -m bench.catalog_scale
	$(BIN)/python -m bench.multirank
	$(BIN)/python -m bench.memory_tier --huge-pages
	$(BIN)/python -m bench.ring
	$(BIN)/python -m bench.rto

clean:
	rm -rf $(VENV) .pytest_cache
