# The two commands a new machine needs (see README.md). Each installs what it
# needs first (scripts/setup.sh is idempotent and fast when nothing is missing).
.PHONY: setup demo test bench

setup:
	@bash scripts/setup.sh

demo: setup
	@.venv/bin/python -m corral.demo

# Two workers (pytest-xdist); a short --basetemp (emptied at each run): a gVisor sandbox's control socket lives under
# its test's directory and a unix socket path has at most 107 bytes (a VM's are in the node's run dir). CORRAL_TEST_TMP for a second run at the same time.
# The API fuzzing runs on its own, in one process: schemathesis gives its cases one test id per test function,
# and xdist, which hands tests out by id, would run one case of each. --durations: the slowest tests in every
# run's log (CI's too), so the default run's time stays watched (well under 20 minutes).
TEST_TMP = $${CORRAL_TEST_TMP:-/tmp/ctest}
FUZZ = tests/integration/test_api_fuzz.py
test: setup
	@status=0; \
	.venv/bin/python -m pytest -q -p no:cacheprovider -n $${CORRAL_TEST_WORKERS:-2} --dist loadgroup \
		--durations=25 --basetemp=$(TEST_TMP) --ignore=$(FUZZ) || status=1; \
	.venv/bin/python -m pytest -q -p no:cacheprovider --basetemp=$(TEST_TMP)-fuzz $(FUZZ) || status=1; \
	exit $$status

bench: setup
	@.venv/bin/corral bench containers
