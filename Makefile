# One command per task. `make demo` and `make test` work on a fresh machine (they set up first).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-unit bench gpu lint clean

$(BIN)/maestro: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first, pinned to the tested version: here pip finds a local CPU wheel of it (a bare
	# `torch` would pull the CUDA wheels); one installed beforehand from PyTorch's CPU index is kept.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(BIN)/maestro

setup: $(BIN)/maestro

data/demo/text.arrow: | setup
	$(BIN)/maestro data demo

demo: setup data/demo/text.arrow
	$(BIN)/maestro run pipelines/distill.py --metrics-out runs/distill-metrics.jsonl

test: setup
	$(BIN)/python -m pytest tests -q --durations=25

test-unit: setup
	$(BIN)/python -m pytest tests/unit -q

bench: setup data/demo/text.arrow
	$(BIN)/python -m tools.bench.p2p_bandwidth
	$(BIN)/python -m tools.bench.control_overhead
	$(BIN)/python -m tools.bench.teacher_memory
	$(BIN)/python -m tools.bench.wavefront_sim
	$(BIN)/python -m tools.bench.planning_time
	$(BIN)/python -m tools.bench.vlm_schedules
	$(BIN)/python -m tools.bench.mixed_precision
	$(BIN)/python -m tools.bench.checkpoint_cost
	$(BIN)/python -m tools.bench.section_memory
	$(BIN)/python -m tools.bench.cuda_ipc
	$(BIN)/python -m tools.bench.baseline_compare --predict
	$(BIN)/python -m tools.bench.vlm_text_only
	$(BIN)/python -m tools.bench.vlm_gap
	$(BIN)/python -m tools.bench.coordinator_scale
	$(BIN)/python -m tools.bench.tune_report
	$(BIN)/python -m tools.bench.wavefront_sim --worst
	$(BIN)/python -m tools.bench.planning_time --padded
	$(BIN)/python -m tools.bench.padding

# On a machine with a GPU: the GPU suite and the GPU benchmarks (tools/bench/RESULTS.md, section 9).
gpu: setup data/demo/text.arrow
	$(BIN)/python -m pytest tests/gpu -q
	$(BIN)/python -m tools.bench.cuda_ipc
	$(BIN)/python -m tools.bench.teacher_throughput
	$(BIN)/python -m tools.bench.section_memory --set sections.student.device=cuda --set sections.teacher.device=cuda

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) data/demo runs *.egg-info
