# The two commands a new machine needs (see README.md). Each installs what it
# needs first (scripts/setup.sh is idempotent and fast when nothing is missing).
.PHONY: setup demo test bench

setup:
	@bash scripts/setup.sh

demo: setup
	@.venv/bin/python -m corral.demo

test: setup
	@.venv/bin/python -m pytest -q -p no:cacheprovider -n $${CORRAL_TEST_WORKERS:-2} --dist loadgroup

bench: setup
	@.venv/bin/corral bench containers
