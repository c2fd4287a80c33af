# One command from nothing: `make train` (the main job) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train demo test test-fast bytecode lint format

# pip compiles the bytecode of what it installs on one core; compileall does it on every core,
# which halves the setup. Like pip, it skips the few files written for a newer Python. Nothing
# here imports the packages' own test suites, pip, or most of transformers' 400 model families
# (40% of the source): those few compile when first imported.
# A current pip first: the venv's own (23.2) spends 21 CPU s choosing the 76 releases, 26.2 7 s.
# gpipe's editable install builds with the venv's setuptools (pulled in above), not a new one.
$(VENV)/.installed: requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check pip==26.2.1
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-compile -r requirements-dev.txt
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-compile --no-deps \
		--no-build-isolation -e .
	$(PY) -c "import compileall, re, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=0, \
		rx=re.compile(r'/(tests|pip)/|/transformers/models/'))" $(VENV)/lib
	touch $@

train: $(VENV)/.installed
	$(PY) -m gpipe train

demo: $(VENV)/.installed
	$(PY) -m gpipe demo

# Three workers on two cores: much of the suite waits (process start-ups, rendezvous, the
# fault tests' timeouts), so a third worker fills that time (273 s against 316 s for two).
# "worksteal" evens out tests of very different lengths.
XDIST := -n 3 --dist worksteal

test: bytecode
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m pytest -q $(XDIST)

# The inner loop: everything that runs in this process (no ranks, no torchrun), about a minute.
test-fast: bytecode
	$(PY) -m pytest -q $(XDIST) -m "not slow"

# Where nothing writes bytecode (PYTHONDONTWRITEBYTECODE), each process the suite starts (fork
# servers, gpipe commands, torchrun's agents and ranks) would compile gpipe again, 0.25 CPU s for
# gpipe train's modules. Compiled here (a second; a no-op when nothing changed), all read it.
bytecode: $(VENV)/.installed
	$(PY) -m compileall -q -j 0 src tests

lint: $(VENV)/.installed
	$(PY) -m ruff check src tests benchmarks examples

format: $(VENV)/.installed
	$(PY) -m ruff format src tests benchmarks examples
