# Entry points: `make demo`, `make test` (`make test-fast` leaves out the slow tests) and `make report`.
# Each creates .venv on first use, with aed installed in it in editable mode (pyproject.toml).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch build that installs quickly on our CI machines (CPU and CUDA capable).
# Override on other machines, e.g. `make demo TORCH_PINS=` to take requirements.txt's ranges as they are.
TORCH_PINS ?= torch==2.14.1 torchaudio==2.11.0

.PHONY: demo test test-fast report venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH_PINS)" ]; then $(VENV)/bin/pip install -q $(TORCH_PINS); fi
	$(VENV)/bin/pip install -q -e .
	touch $@

test: venv
	$(PY) -m pytest -q tests

# Under a minute on 2 CPU cores: all but the tests marked slow (training runs, scripts in subprocesses, overfitting).
test-fast: venv
	$(PY) -m pytest -q -m "not slow" tests

# Trains the tiny model on the bundled digits set (~6 min on 2 CPU cores; dev WER before/after is
# in the log), then transcribes the dev set's unseen digit strings with it and scores them.
demo: venv
	rm -rf runs/demo
	$(PY) train.py configs/tiny.yaml run_dir=runs/demo
	$(PY) infer.py --ckpt runs/demo --manifest data/mini/digits/dev.jsonl

# The paper's experiments at CPU scale -> docs/REPORT.md and its plots (~30 min on 2 CPU cores).
report: venv
	$(VENV)/bin/pip install -q -r bench/requirements-report.txt
	$(PY) bench/report.py --work-dir runs/report/work

clean:
	rm -rf $(VENV) runs/demo aed.egg-info
