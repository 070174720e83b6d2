#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the llama.cpp sources inside the llama-cpp-python
# sdist that the in-process engine uses (same version, so the same llama.cpp commit), and
# installs the binary as $VENV/bin/llama-server. Run once by `make llama-server`; the result
# is kept (about 4 minutes on 2 cores). With a second argument `invariant` (`make
# llama-server-invariant`): the same sources with three lines changed, so that llamafile's
# tinyBLAS multiplies every batch, one token included (upstream it declines fewer than 2
# tokens, which then take ggml's vec_dot kernels: a lone decode step and the same step
# batched with another slot's rounded differently), and CPU flash attention computes every
# query row on its own (upstream it takes a split-KV path for a lone decode step and a tiled
# one for many rows), whose results do not depend on what a request is batched with
# (ServerLaunch.batch_invariant): a copy of the sources and a build folder of their own,
# installed as $VENV/bin/llama-server-invariant.
#   cmake: the server on, the prebuilt web UI off (it would be downloaded), OpenSSL off
#   (loopback HTTP only), static libraries (one self-contained binary), Ninja, and no AMX
#   kernels (NO_AMX).
set -euo pipefail
VENV=${1:-.venv}
VARIANT=${2:-}
case "$VARIANT" in
    "") BUILD=build; NAME=llama-server ;;
    invariant) BUILD=batch-invariant-src/build; NAME=llama-server-invariant ;;
    *) echo "unknown variant: $VARIANT (none, or invariant)" >&2; exit 2 ;;
esac
VERSION=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')
WORK=build/llama-server-src
mkdir -p "$WORK"
SDIST="$WORK/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    "$VENV/bin/python" -m pip download --quiet --no-binary :all: --no-deps \
        "llama-cpp-python==$VERSION" -d "$WORK"
fi
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -d "$SRC" ] || tar -xzf "$SDIST" -C "$WORK"
if [ "$VARIANT" = invariant ]; then
    # the sources again, in a folder of their own, with tinyBLAS taken for every batch size and
    # CPU flash attention on one path for every batch (its per-row kernel)
    COPY="$WORK/batch-invariant-src"
    if [ ! -d "$COPY" ]; then
        rm -rf "$COPY.partial" && mkdir -p "$COPY.partial"
        tar -xzf "$SDIST" -C "$COPY.partial"
        "$VENV/bin/python" - "$COPY.partial/llama_cpp_python-$VERSION/vendor/llama.cpp/ggml/src/ggml-cpu" <<'PY'
import sys
from pathlib import Path
cpu = Path(sys.argv[1])
CHANGES = [  # (file, the text upstream, the text here)
    ("llamafile/sgemm.cpp",  # tinyBLAS for one token row too, not ggml's vec_dot
     "    // only enable sgemm for prompt processing\n#if !defined(__MMA__)\n    if (n < 2)\n",
     "    // every batch size, one token included: batch-invariant (PerCache)\n#if !defined(__MMA__)\n    if (n < 1)\n"),
    ("ops.cpp",  # flash attention: no split-KV path for a lone decode step
     "const bool use_split_kv_path = !use_ref && ",
     "const bool use_split_kv_path = false && !use_ref && "),
    ("ops.cpp",  # flash attention: no tiled path for many query rows (each row on its own)
     "        bool use_tiled = !use_ref &&\n",
     "        bool use_tiled = false && !use_ref &&\n"),
]
for name, before, after in CHANGES:
    path = cpu / name
    text = path.read_text()
    if text.count(before) != 1:
        sys.exit(f"{path}: the text to change is not there once (another llama.cpp version?)")
    path.write_text(text.replace(before, after))
PY
        mv "$COPY.partial" "$COPY"
    fi
    SRC="$COPY/llama_cpp_python-$VERSION/vendor/llama.cpp"
fi
GENERATOR=()
command -v ninja >/dev/null 2>&1 && GENERATOR=(-G Ninja)
# NO_AMX (set by the Makefile): compiled for this CPU without llama.cpp's AMX kernels, as
# llama-cpp-python is (the Makefile says why)
: "${NO_AMX:?run by make llama-server, which sets NO_AMX}"
cmake -S "$SRC" -B "$WORK/$BUILD" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$WORK/$BUILD" --target llama-server -j "$(nproc)" >/dev/null
install -m 755 "$WORK/$BUILD/bin/llama-server" "$VENV/bin/$NAME"
echo "$VENV/bin/$NAME: llama.cpp from llama-cpp-python $VERSION"
