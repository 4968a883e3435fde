# Two entry points for a fresh machine (see README.md): `make run` and `make test`.
# Everything is installed into .venv from this repository's own pyproject.toml.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: run test bench perf-page clean multihost-deps bytecode

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The runtime install (ray, numpy, msgpack, matplotlib): enough for the main job.
$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

# Tests also need the dev tools and the compile extra (apache-tvm, onnx, torch CPU).
$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev,compile]'
	touch $@ $(VENV)/.runtime

# The editable install leaves tvmpipe's modules as source only, and with PYTHONDONTWRITEBYTECODE set
# (as in this dev sandbox) every process (each stage actor, each test subprocess) compiled them again:
# ~0.1 CPU-s a process on the 2-core VM. Compiled here, once per change (compileall skips what is
# current); Python still reads a stale .pyc's source instead.
bytecode: | $(BIN)/python
	@$(BIN)/python -c "import compileall, sys, tomllib; dirs = tomllib.load(open('pyproject.toml', 'rb'))['tool']['setuptools']['package-dir'].values(); sys.exit(not all([compileall.compile_dir(d, quiet=1) for d in dirs]))"

run: $(VENV)/.runtime bytecode
	$(BIN)/tvmpipe run --stages 2 --local

# tests/multihost runs `ray up` over SSH inside network namespaces: it needs sshd and rsync. Installed
# only as root with apt and only when missing; policy-rc.d (kept if the system has one) stops apt from
# starting an sshd on the machine itself. Without them those tests say what is missing and skip.
multihost-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! { [ -x /usr/sbin/sshd ] && command -v rsync >/dev/null; }; then \
	  own=; [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; own=1; }; \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openssh-server openssh-client rsync; } >/dev/null || echo "multihost-deps: apt-get failed"; \
	  [ -z "$$own" ] || rm -f /usr/sbin/policy-rc.d; \
	fi

test: $(VENV)/.dev multihost-deps bytecode
	$(BIN)/python -m pytest

# Every bench script (each writes its bench/results/*.json), then the page made from those files.
bench: $(VENV)/.dev bytecode
	for b in bench/*.py; do case $$b in bench/perfpage.py|bench/stamp.py|bench/gpu_gate.py|bench/real_bundles.py) continue;; esac; \
	  $(BIN)/python $$b || exit 1; done
	$(MAKE) perf-page

# docs/performance.md from bench/results/*.json (tests/bench/test_perfpage.py checks it is current).
perf-page: $(VENV)/.runtime
	$(BIN)/python bench/perfpage.py

clean:
	rm -rf $(VENV) .pytest_cache
