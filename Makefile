PY ?= .venv/bin/python
PIP ?= $(PY) -m pip

.PHONY: install stubs test test-sglang test-trl lint demo demo-quick demo-agent daemon-demo serve \
	gpu-check gpu-check-dry gpu-wheels

# torch==2.13.0 first: on CPU-only machines it is a local CPU build; anything that admits a
# newer torch would otherwise download a multi-GB CUDA build.
# The project's own modules are compiled once here: where PYTHONDONTWRITEBYTECODE is set (CI
# and these VMs), each daemon, worker and test process would otherwise compile them again
# (~0.5 s of every daemon's start). Imports check each file's timestamp: an edited module is
# compiled from source, never read stale.
install:
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[daemon,torch,postgres,dev]"
	$(PY) -m compileall -q -j 0 tltd workers clients tests benchmarks examples > /dev/null

# The one pinned command that produces the committed stubs (tests/api/test_stubs.py checks them).
stubs:
	$(PY) -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. protos/tltd/v1/*.proto

# Two test processes, whole files to each: most tests wait (daemons starting, leases running
# out, streams), so one process left the 2 cores ~40% busy. On a quiet 2-core machine a fresh
# clone's `make test` (install included) took 9.3 and 9.9 min with two. Three and four were
# faster (the suite 11.7 -> 10.2 and 9.5 min on a slower day), but each test then ran 30-60%
# longer, and tests with 1.5-3 s leases or heartbeats failed under that load.
# TEST_WORKERS=0 runs it in this process. Files go out longest first (tests/durations.py),
# not by their number of tests.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The SGLang adapter against the real sglang package, in its own cached environment (CPU
# torch, sglang with --no-deps: scripts/sglang_contract_env.sh; the project itself is installed
# there too, for its package names); --confcutdir keeps the
# suite's database fixtures out of it.
test-sglang:
	venv=$$(PYTHON=$(PY) bash scripts/sglang_contract_env.sh) && \
	$$venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . && \
	TLTD_SGLANG_CONTRACT=1 $$venv/bin/python -m pytest -q -p no:cacheprovider \
		--confcutdir=tests/sglang_contract tests/sglang_contract

# TRL's own VLLMClient against a real daemon: the client in its own cached environment (CPU
# torch, trl: scripts/trl_client_env.sh), the daemon and the tests in the project's. A failed
# build fails the target.
test-trl: install
	venv=$$(PYTHON=$(PY) bash scripts/trl_client_env.sh) && \
	TLTD_TRL_PYTHON=$$venv/bin/python $(PY) -m pytest -q -p no:cacheprovider tests/trl_client

lint:
	$(PY) -m ruff check .

# README command 1: GRPO through a real `tltd serve`, TLT vs speculative decoding off.
demo: install
	$(PY) examples/grpo_demo.py

demo-quick: install
	$(PY) examples/grpo_demo.py --quick

# GRPO over multi-turn sessions: the policy calls a calculator tool (examples/agent_demo.py).
demo-agent: install
	$(PY) examples/agent_demo.py

# The daemon alone answering tltctl (no rollouts).
daemon-demo: install
	$(PY) examples/daemon_demo.py

# The prepared GPU check (docs/backends.md): gpu-wheels here, gpu-check on a lent GPU machine
# with .whl carried (OUT: where the report goes), gpu-check-dry the same steps on the CPU (CI).
OUT ?= out/gpu-check
gpu-wheels:
	PY=$(PY) bash scripts/gpu_wheels.sh

gpu-check:
	bash scripts/gpu_check.sh $(OUT)

gpu-check-dry: install
	PY=$(PY) bash scripts/gpu_check.sh --dry-run $(OUT)
