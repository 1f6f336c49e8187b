#!/usr/bin/env bash
# Builds arctic-inference's suffix decoding cache (arctic_inference.suffix_decoding: its C++ suffix tree and
# the Python class over it) into .venv, for benchmarks/suffix_speed.py and benchmarks/suffix_vs_arctic.py.
# The package's own build needs torch (its other extensions); this one needs a C++20 compiler, CMake and
# nanobind, which it installs into a build environment of its own.
#
#   bash benchmarks/build_arctic_suffix.sh            # arctic-inference 0.3.0
#   ARCTIC_VERSION=0.2.1 bash benchmarks/build_arctic_suffix.sh
set -euo pipefail
version=${ARCTIC_VERSION:-0.3.0}
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/env"
"$work/env/bin/pip" install -q cmake ninja nanobind==2.9.2
# The source archive from the index (pip would read its metadata, which imports torch).
url=$(curl -fsSL "${INDEX:-https://pypi.org/simple}/arctic-inference/" \
  | grep -o "https://[^\"#]*/arctic_inference-$version\.tar\.gz" | head -1)
curl -fsSL "$url" -o "$work/arctic.tar.gz"
tar -xzf "$work/arctic.tar.gz" -C "$work"
src="$work/arctic_inference-$version"
PATH="$work/env/bin:$PATH" cmake -S "$src/csrc/suffix_decoding" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$work/env/bin/python" > "$work/cmake.log"
PATH="$work/env/bin:$PATH" ninja -C "$work/build" > "$work/ninja.log"
site=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$site/arctic_inference/suffix_decoding"
cp "$src/arctic_inference/__init__.py" "$site/arctic_inference/"
cp "$src"/arctic_inference/suffix_decoding/*.py "$work"/build/_C*.so "$site/arctic_inference/suffix_decoding/"
"$python" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; print('arctic-inference $version:', SuffixDecodingCache)"
