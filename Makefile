# The two commands a new machine needs (see README.md). Each installs what it
# needs first (scripts/setup.sh is idempotent and fast when nothing is missing).
.PHONY: setup demo test bench

setup:
	@bash scripts/setup.sh

demo: setup
	@.venv/bin/python -m corral.demo

# Two workers (pytest-xdist); a short --basetemp (emptied at each run): a VM's sockets live under its test's
# directory and a unix socket path has at most 107 bytes. CORRAL_TEST_TMP for a second run at the same time.
test: setup
	@.venv/bin/python -m pytest -q -p no:cacheprovider -n $${CORRAL_TEST_WORKERS:-2} --dist loadgroup \
		--basetemp=$${CORRAL_TEST_TMP:-/tmp/ctest}

bench: setup
	@.venv/bin/corral bench containers
