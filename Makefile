# Fresh-machine entry points: `make demo` and `make test` (README).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export WANDB_MODE ?= offline
export WANDB_SILENT ?= true

.PHONY: demo test test-fast test-compat lint bench bench-grid emulated-map clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch/torchvision: the versions the test suite is run against (pyproject.toml states the supported range)
	$(PY) -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
	# every extra: the CLI and example data, W&B, the demo/benchmark tools, the test runner and linters
	$(PY) -m pip install --quiet -e ".[examples,wandb,bench,test]"
	touch $(STAMP)

# The lowest releases pyproject.toml admits (Lightning, torch and the torchvision built for it), in a venv of their
# own built as `venv` builds .venv; the stamp names the versions, so changing one rebuilds it
COMPAT_LIGHTNING   := 2.5.0
COMPAT_TORCH       := 2.8.0
COMPAT_TORCHVISION := 0.23.0
COMPAT_VENV  := .venv-compat
COMPAT_PY    := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed-$(COMPAT_LIGHTNING)-$(COMPAT_TORCH)-$(COMPAT_TORCHVISION)
COMPAT_PINS  := "lightning==$(COMPAT_LIGHTNING)" "torch==$(COMPAT_TORCH)" "torchvision==$(COMPAT_TORCHVISION)"

$(COMPAT_STAMP): pyproject.toml
	$(PYTHON) -m venv --clear $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install --quiet --upgrade pip
	$(COMPAT_PY) -m pip install --quiet "torch==$(COMPAT_TORCH)" "torchvision==$(COMPAT_TORCHVISION)"
	$(COMPAT_PY) -m pip install --quiet -e ".[examples,wandb,bench,test]" $(COMPAT_PINS)
	touch $(COMPAT_STAMP)

demo: $(STAMP)
	$(PY) benchmarks/demo.py

# two workers, whole files each (module-scoped jobs are shared by a file's tests); `pytest -q` runs serially
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# everything but the tests that start real ranks or take long (markers in tests/conftest.py)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not realrank and not slow"

# test-fast's tests and one 2-rank fit (the wheel's `lightning-pgc fit`, strategy pgc) on the lowest releases
test-compat: $(COMPAT_STAMP)
	$(COMPAT_PY) -m pytest -q -n 2 --dist loadfile -m "not realrank and not slow"
	$(COMPAT_PY) -m pytest -q tests/test_packaging.py::test_wheel_installs_and_runs_a_packaged_recipe_from_any_directory

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) benchmarks/step_time.py

bench-grid: $(STAMP)
	$(PY) benchmarks/grid.py

# the emulated crossover map (resumable: rerun to resume; ROUND=reduced for the reduced round, TASKS= the proxy
# tasks; its cost: docs/results/emulator.md), its tables, README's table and the guide's map section
ROUND ?= full
TASKS ?= mlp
emulated-map: $(STAMP)
	OMP_NUM_THREADS=1 nice -n 10 $(PY) benchmarks/emulated_map.py --round $(ROUND) --tasks $(TASKS) --workers 2
	$(PY) benchmarks/emulated_render.py --summary docs/results/emulated_map_$(ROUND).json
	$(PY) benchmarks/which_strategy.py --summary docs/results/emulated_map_$(ROUND).json

clean:
	rm -rf $(VENV) $(COMPAT_VENV) outputs lightning_logs wandb
