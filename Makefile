# Every target creates or reuses .venv and installs tailspec (editable) with what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tailspec-installed

.PHONY: demo test bench lint clean-venv

# Everything the project promises is installed, DeepSpeed included, so only GPU tests skip on CPU.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[dev,deepspeed]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tailspec demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/tailspec bench

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
