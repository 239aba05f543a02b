#!/usr/bin/env bash
# Bundle another FlashInfer release for the GPU machine (CPython 3.12, no network), next to the 0.6.8.post1 of
# .device/flashinfer.tar.xz, for the decode benchmark's FP8 baselines (benchmarks/NOTES.md, "FP8 baselines").
#
#   bash benchmarks/fi_bundle.sh [VERSION]        (from the project root; VERSION defaults to 0.7.4)
#
# Writes .xfer/flashinfer-VERSION.tar.xz (ignored by git): flashinfer-python VERSION + apache-tvm-ffi + cuda-tile,
# unpacked into one site directory, the C++/CUDA sources pruned to what the decode baselines compile (the XQA
# kernels, the FA2/FA3 paged kernels: data/include, data/cutlass, data/cccl, data/spdlog, data/csrc/*,
# data/csrc/xqa), and the XQA kernels of the sweep prebuilt for sm_90a into FlashInfer's own AOT directory
# (flashinfer/data/aot, loaded before FlashInfer would JIT-compile) when nvcc is at $CUDA_HOME (13.0, as on the GPU
# machine) and torch imports here. Too large to travel with .device (64 MiB in all): carry it in a call of its own
# that unpacks it into /tmp/fi-VERSION, then put that first on PYTHONPATH in later calls, e.g.
#   run(command="mkdir -p /tmp/fi-0.7.4 && tar -C /tmp/fi-0.7.4 -xJf .xfer/flashinfer-0.7.4.tar.xz", carry=[".xfer"])
#   run(command="source .device/env.sh && export PYTHONPATH=/tmp/fi-0.7.4:$PYTHONPATH && python -m benchmarks.decode
#                --methods flashinfer-fp8,flashinfer-fp8-xqa,...", carry=[".device"])
set -euo pipefail
VERSION=${1:-0.7.4}
TVM_FFI=0.1.15.post2   # as .device/flashinfer.tar.xz holds beside 0.6.8.post1; 0.7.4 needs >=0.1.11,<0.2
CUDA_TILE=1.7.0
ROOT=$(git rev-parse --show-toplevel)
OUT="$ROOT/.xfer/flashinfer-$VERSION.tar.xz"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/site" "$ROOT/.xfer"

python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$tmp/whl" "flashinfer-python==$VERSION" \
  "apache-tvm-ffi==$TVM_FFI" "cuda-tile==$CUDA_TILE"
for w in "$tmp"/whl/*.whl; do (cd "$tmp/site" && python3 -m zipfile -e "$w" .); done

# C++/CUDA sources the decode baselines do not compile (the wheel unpacks to ~715 MB, mostly kernel sources)
python3 - "$tmp/site/flashinfer" <<'PY'
import pathlib, sys
pkg = pathlib.Path(sys.argv[1])
sources = {".cu", ".cuh", ".h", ".hpp", ".inl", ".cpp", ".cc", ".c", ".inc", ".ptx"}
kept_dirs = ("data/include/", "data/cutlass/", "data/cccl/", "data/spdlog/", "data/csrc/xqa/")
for path in pkg.rglob("*"):
    rel = path.relative_to(pkg).as_posix()
    top_csrc = rel.startswith("data/csrc/") and rel.count("/") == 2
    if path.is_file() and path.suffix in sources and not (rel.startswith(kept_dirs) or top_csrc):
        path.unlink()
PY
find "$tmp/site" -type d -empty -delete

if [ -x "$CUDA_HOME/bin/nvcc" ] && python3 -c "import torch" 2>/dev/null; then
  # importing flashinfer here needs tvm-ffi (and pynvml) for this machine's Python, in front of the cp312 ones
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp/host-whl" "apache-tvm-ffi==$TVM_FFI" nvidia-ml-py
  mkdir -p "$tmp/host"
  for w in "$tmp"/host-whl/*.whl; do (cd "$tmp/host" && python3 -m zipfile -e "$w" .); done
  stubs=""
  if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so ' && [ ! -e "$CUDA_HOME/lib64/stubs/libcuda.so" ]; then
    # no driver here: the XQA modules link -lcuda; a stub named as the driver's library satisfies the link
    mkdir -p "$tmp/stubs" && echo "" > "$tmp/stubs/empty.c"
    cc -shared -Wl,-soname,libcuda.so.1 -o "$tmp/stubs/libcuda.so" "$tmp/stubs/empty.c"
    stubs="$tmp/stubs"
  fi
  (cd "$ROOT" && PYTHONPATH="$tmp/host:$tmp/site" FLASHINFER_CUDA_ARCH_LIST=9.0a \
     FLASHINFER_WORKSPACE_BASE="$tmp/jit" LIBRARY_PATH="$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}" \
     python3 -m benchmarks.fi_xqa_aot "$tmp/site")
else
  echo "no nvcc at $CUDA_HOME/bin or no torch here: XQA kernels not prebuilt (the GPU machine JIT-compiles them" \
       "at first use)" >&2
fi

echo "compressing (xz, a few minutes)..." >&2
tar -C "$tmp/site" -cf - . | xz --x86 --lzma2=preset=9e,dict=256MiB -T1 > "$OUT.part"
mv "$OUT.part" "$OUT"
echo "wrote $OUT: $(stat -c %s "$OUT") bytes"
