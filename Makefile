# meshplan developer entry points. Works on a fresh clone with nothing installed:
# `make test` builds $(VENV) first (about two minutes), later runs reuse it.

VENV ?= .venv
PY = $(VENV)/bin/python
# Installed BEFORE the project so pip never resolves a bare `torch` (a CUDA build of several GB).
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest-xdist workers (tests/conftest.py: tests/dist/ on one of them, in turn)
TEST_WORKERS ?= 2

.PHONY: demo test clean browser slurm

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[mpi,kernels,k8s,agents,test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/meshplan demo

test: $(VENV)/.installed browser slurm
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Headless Chromium for the test of `meshplan plan show --html` (Debian's package). Installed
# when missing and apt-get can (root); otherwise that one test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && timeout 600 apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; } \
	  || echo "note: chromium is not installed; the HTML page's browser test will skip"

# Slurm's daemons and client and munge (Debian's packages, about 10 MB) for the tests that run
# launcher="slurm" against a real slurmctld/slurmd in `meshplan sandbox up --slurm`. Installed
# when missing and apt-get can (root); otherwise those tests skip and say why. Installing
# starts no daemon (the sandbox starts its own, in its namespaces).
slurm:
	@command -v slurmctld >/dev/null 2>&1 || PATH="$$PATH:/usr/sbin" command -v slurmctld >/dev/null 2>&1 \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && { \
	    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1 \
	    || { timeout 300 apt-get update >/dev/null 2>&1 \
	         && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1; }; }; } \
	  || echo "note: Slurm is not installed; the slurm launcher's cluster tests will skip"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info build/ dist/
	find . -path './.venv*' -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
