# The two commands of README: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=25.1"
	# torch first and pinned: 2.13.0 is the CPU wheel on this machine's disk; any looser
	# requirement would pull a multi-gigabyte CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[safetensors]" --group test --group bench
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Two workers: most of the suite's time is spent waiting on child processes, sleeps and fsyncs,
# so on 2 cores it runs in about 5 minutes instead of 8.
test: $(STAMP)
	$(PY) -m pytest -n 2

bench: $(STAMP)
	$(PY) bench/run.py

lint: $(STAMP)
	$(PY) -m pip install --quiet --group lint
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build dist
