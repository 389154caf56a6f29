# The two commands of the README: `make demo` and `make test`. Both set up .venv first
# (scripts/setup.sh returns at once when .venv is already complete).
PY := .venv/bin/python
export LOCAL_WORLD_SIZE ?= 2
# pytest workers: one per core and one more, which runs while the others' ranks wait on each
# other; each test file stays on one worker, so a module's fixture is built once, and the
# modules marked slow start first (tests/conftest.py). Measured on 2 cores: one process 364 s,
# 2 workers 272 s, 3 workers 258 s. The ten slowest tests are listed at the end.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))

.PHONY: setup demo test lint

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/embckpt demo --config configs/demo.yaml --out demo_out

lint: setup
	$(PY) -m ruff check embckpt tests benchmarks
	$(PY) -m ruff format --check embckpt tests benchmarks
	$(PY) -m mypy

test: lint
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10
