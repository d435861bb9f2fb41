# Every target creates or reuses .venv and installs tailspec (editable) with what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tailspec-installed

.PHONY: demo test bench lint clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[dev]"
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
