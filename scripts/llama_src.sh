#!/usr/bin/env bash
# llama.cpp's sources, trimmed to what a CPU or CUDA build of libllama needs, for the `llama`
# section of scripts/gpu.sh (the GPU machine has no network).
#
#   scripts/llama_src.sh [SDIST] [DIR]
#
# SDIST is the llama-cpp-python source archive, which vendors llama.cpp under vendor/llama.cpp
# (default /tmp/llama/llama_cpp_python-0.3.36.tar.gz); DIR (default .device, which git ignores)
# receives llama.tar.gz (a folder llama.cpp/: CMakeLists.txt, LICENSE, cmake/, include/, src/,
# vendor/, ggml/ with the CPU and CUDA backends only) and the gguf wheel found beside SDIST
# (gguf-*.whl: pure Python, needing numpy, which the GPU machine has), which the section puts on
# PYTHONPATH as it is. Left out: the tools, examples, tests, models, docs, common/ (the section
# builds examples/cpp/llama_greedy.cpp against libllama alone) and the header-only vendored
# libraries that libllama does not include (their CMakeLists.txt stay, so that CMake configures).
set -euo pipefail
cd "$(dirname "$0")/.."
sdist=${1:-/tmp/llama/llama_cpp_python-0.3.36.tar.gz}
dir=${2:-.device}
[ -f "$sdist" ] || { echo "no $sdist (pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36)" >&2; exit 2; }
wheel=$(ls "$(dirname "$sdist")"/gguf-*.whl 2>/dev/null | head -1 || true)
[ -n "$wheel" ] || { echo "no gguf wheel beside $sdist (pip download --no-deps gguf)" >&2; exit 2; }
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
top=$(basename "$sdist" .tar.gz)
tar xzf "$sdist" -C "$tmp" "$top/vendor/llama.cpp"
src="$tmp/$top/vendor/llama.cpp"
dst="$tmp/llama.cpp"
mkdir -p "$dst/ggml/src"
cp -r "$src"/{CMakeLists.txt,LICENSE,licenses,cmake,include,src,vendor} "$dst/"
cp -r "$src"/ggml/{CMakeLists.txt,cmake,include} "$dst/ggml/"
# ggml's core files and the two backends; ggml/src/CMakeLists.txt adds a backend's folder only
# when its GGML_<NAME> option is on.
find "$src/ggml/src" -maxdepth 1 -type f -exec cp {} "$dst/ggml/src/" \;
cp -r "$src"/ggml/src/{ggml-cpu,ggml-cuda} "$dst/ggml/src/"
rm -rf "$dst/vendor/cpp-httplib"/*.{h,cpp} "$dst/vendor/miniaudio/miniaudio.h" "$dst/vendor/stb/stb_image.h"
tar czf "$dir/llama.tar.gz" -C "$tmp" llama.cpp
cp "$wheel" "$dir/"
echo "$dir/llama.tar.gz: $(du -h "$dir/llama.tar.gz" | cut -f1) ($(du -sh "$dst" | cut -f1) unpacked); $dir/$(basename "$wheel")"
