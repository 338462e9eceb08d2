# What CI uses is pinned in deploy/requirements.txt (which the container image installs too) and, for tests,
# deploy/requirements-dev.txt; pyproject.toml states the ranges geotrain works with.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PINS := deploy/requirements.txt deploy/requirements-dev.txt
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast proto clean

venv: $(STAMP)

# torch goes in the same pip command as hivemind: alone, hivemind pulls a multi-GB CUDA torch.
$(STAMP): pyproject.toml setup.py Makefile $(PINS) geotrain/compression/_blockquant.c geotrain/protocol/_streamio.c geotrain/node/_gradsums.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r deploy/requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

demo: $(STAMP)
	$(BIN)/geotrain demo

# The status page test drives headless Chromium; install Debian's when we may (root with apt), else it skips.
# Two tests at a time (pytest-xdist, stealing work so that no worker idles at the end): a multi-process test
# leaves about a third of two cores idle while its processes wait on each other.
test: $(STAMP)
	if [ "$$(id -u)" = 0 ] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then \
		(apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
		echo "chromium could not be installed: the browser test will skip"; fi
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

# What needs no cluster: no coordinator, node, CLI or DHT processes; well under a minute.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not cluster"

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. geotrain/protocol/geotrain.proto

clean:
	rm -rf $(VENV) build *.egg-info
	find geotrain -name '*.so' -delete
