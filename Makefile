# Entry points: `make demo`, `make test` (`make test-fast` leaves out the slow tests; `make test-other-kernels`
# runs those under another CPU instruction set's kernels), `make report`,
# and `make gpu-check` on a machine with a CUDA GPU. Each creates .venv on first use (`make setup`
# alone does just that), with aed installed in it in editable mode (pyproject.toml).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch build that installs quickly on our CI machines (CPU and CUDA capable).
# Override on other machines, e.g. `make demo TORCH_PINS=` to take requirements.txt's ranges as they are.
TORCH_PINS ?= torch==2.14.1 torchaudio==2.11.0
# CPU-only machines: `make setup CPU=1` takes torch from PyTorch's CPU wheel index (~200 MB) instead
# of the default CUDA build (~5 GB of CUDA libraries that a machine without a GPU never loads).
CPU ?=
CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_SOURCE := $(if $(CPU),--index-url $(CPU_INDEX),)

.PHONY: setup demo test test-fast test-other-kernels test-nemo gpu-check report venv clean

setup: venv

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml tests/requirements-hf.txt tests/requirements-onnx.txt
	$(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH_PINS)$(CPU)" ]; then $(VENV)/bin/pip install -q $(TORCH_SOURCE) $(or $(TORCH_PINS),torch torchaudio); fi
	$(VENV)/bin/pip install -q -e .
	# Optional at run time (parquet sources name it when missing); the suite tests that reader too.
	$(VENV)/bin/pip install -q pyarrow
	# Optional at run time: infer.py's speech detector where installed (it keeps music out of long-form
	# segments and streams; energy otherwise, with a line saying so). The suite tests both.
	$(VENV)/bin/pip install -q "silero-vad>=6.2,<7"
	# The runtimes the exports are checked by (transformers, onnxruntime, sherpa-onnx: ~2 minutes);
	# NeMo's is `make test-nemo`'s.
	$(VENV)/bin/pip install -q -r tests/requirements-hf.txt -r tests/requirements-onnx.txt
	touch $@

# Two workers: the suite is mostly single-threaded subprocesses. Slow tests are collected first
# (tests/conftest.py) and an idle worker takes queued tests from the busy one (worksteal), so the
# long runs start early and neither worker ends alone on one of them.
test: venv
	$(PY) -m pytest -q -n 2 --dist worksteal tests

# NeMo's own runtime on the .nemo exports (tests/test_export_nemo.py: restore_from, features and
# greedy tokens equal aed's), about a minute. NeMo 3.0.0 and what it imports (~780 MB, ~2 minutes to
# install the first time) live in $(NEMO_PEERS), apart from the venv: NeMo needs transformers 4.x.
NEMO_PEERS := $(VENV)/nemo-peers
$(NEMO_PEERS)/.installed: bench/requirements-nemo-peers.txt | venv
	$(VENV)/bin/pip install -q --target $(NEMO_PEERS) --no-deps -r bench/requirements-nemo-peers.txt
	touch $@

test-nemo: venv $(NEMO_PEERS)/.installed
	AED_REQUIRE_NEMO=1 PYTHONPATH=$(NEMO_PEERS) $(PY) -m pytest -q -rs tests/test_export_nemo.py

# About a minute on 2 CPU cores: all but the tests marked slow (training runs, scripts in subprocesses,
# overfitting), on both cores as `make test` runs.
test-fast: venv
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow" tests

# test-fast again with PyTorch's CPU kernels for another instruction set than this CPU's best (AVX-512 ->
# AVX2, AVX2 -> the compiler's own vectorisation): a test whose verdict follows the kernels' rounding
# fails on the machine that brings it in, not on the next host. CI runs it after `make test`.
test-other-kernels: venv
	@native=$$($(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	case $$native in avx512*) other=avx2 ;; avx2) other=default ;; \
	  *) echo "test-other-kernels: this CPU's kernels ($$native) have no other set to compare with"; exit 0 ;; esac; \
	echo "test-fast with ATEN_CPU_CAPABILITY=$$other (this CPU's own: $$native)"; \
	ATEN_CPU_CAPABILITY=$$other $(PY) -m pytest -q -n 2 --dist worksteal -m "not slow" tests

# The CUDA paths (bf16 step, NCCL, real OOMs, bf16 inference, GPU<->CPU checkpoints and NeMo models,
# the simulated device against the real one, the compiled decoder step as a CUDA graph, compiled and
# checkpointed training steps), the inference speed of eager and compiled decoding and of streams, the
# training step's speed, then which GPU and torch build they ran on.
gpu-check: venv
	@$(PY) -c "import torch, sys; torch.cuda.is_available() or sys.exit('gpu-check: torch sees no CUDA GPU')"
	$(PY) -m pytest -q -rfEs tests/test_cuda.py tests/test_cuda_oom.py
	$(PY) bench/infer_speed_bench.py --device cuda --no-peers --utterances 16 --long-seconds 300  # eager vs CUDA graphs
	$(PY) bench/infer_speed_bench.py stream --device cuda --streams 1 4 16 64  # concurrent real-time streams
	$(PY) bench/train_speed_bench.py configs/canary-180m-flash.yaml --device cuda --compile both --checkpointing none both  # the training step
	@$(PY) -c "import torch; print('gpu-check passed on', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)"

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
