#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the llama.cpp sources inside the llama-cpp-python
# sdist that the in-process engine uses (same version, so the same llama.cpp commit), and
# installs the binary as $VENV/bin/llama-server. Run once by `make llama-server`; the result
# is kept (about 4 minutes on 2 cores). With a second argument `invariant` (`make
# llama-server-invariant`): the same build without llamafile's kernels (-DGGML_LLAMAFILE=OFF),
# whose results do not depend on what a request is batched with (ServerLaunch.batch_invariant),
# in a build folder of its own, installed as $VENV/bin/llama-server-invariant.
#   cmake: the server on, the prebuilt web UI off (it would be downloaded), OpenSSL off
#   (loopback HTTP only), static libraries (one self-contained binary), Ninja, and no AMX
#   kernels (NO_AMX).
set -euo pipefail
VENV=${1:-.venv}
VARIANT=${2:-}
case "$VARIANT" in
    "") BUILD=build; NAME=llama-server; EXTRA=() ;;
    invariant) BUILD=build-invariant; NAME=llama-server-invariant; EXTRA=(-DGGML_LLAMAFILE=OFF) ;;
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
GENERATOR=()
command -v ninja >/dev/null 2>&1 && GENERATOR=(-G Ninja)
# NO_AMX (set by the Makefile): compiled for this CPU without llama.cpp's AMX kernels, as
# llama-cpp-python is (the Makefile says why)
: "${NO_AMX:?run by make llama-server, which sets NO_AMX}"
cmake -S "$SRC" -B "$WORK/$BUILD" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release "${EXTRA[@]}" \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$WORK/$BUILD" --target llama-server -j "$(nproc)" >/dev/null
install -m 755 "$WORK/$BUILD/bin/llama-server" "$VENV/bin/$NAME"
echo "$VENV/bin/$NAME: llama.cpp from llama-cpp-python $VERSION"
