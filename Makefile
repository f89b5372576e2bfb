# The two commands of the README: `make demo` (the main job) and `make test`.
# Both do all set-up on a fresh machine: a virtualenv with the pinned dependencies.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: setup test demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

test: setup
	$(PY) -m pytest -q

# Translate a few Multi30K test sentences with the shipped de->en model
# (trained here first if models/ does not have it).
demo: setup
	$(PY) -m training.demo

clean:
	rm -rf $(VENV) runs
