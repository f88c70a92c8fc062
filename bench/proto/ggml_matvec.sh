#!/usr/bin/env bash
# llama.cpp's own matrix-vector rate on this host, for comparison with jspec's
# block kernel (docs/decisions-compact.md, "Where llama.cpp's lead comes from
# on the Zen 5 host"). Builds test-backend-ops from the same pinned
# llama-cpp-python sdist the bench uses, with two changes: its thread count
# comes from TBO_THREADS (it runs half the host's threads otherwise: one on a
# 2-core host), and it gains the 1.5B target's gate shape stacked 8 times,
# [1536 -> 71680] (62 MB as Q4_K, past the 32 MiB L3), at 1, 2, 3, 5 and 9 rows.
#
#   bash bench/proto/ggml_matvec.sh [WORK_DIR]      # ~5 minutes the first time
#
# Prints each case's microseconds per call; weights per ns = 71680 * 1536 / (us * 1000).
set -euo pipefail
work=${1:-/tmp/ggml_matvec}
version=0.3.36
mkdir -p "$work"
cd "$work"
if [ ! -d "llama_cpp_python-$version" ]; then
  python -m pip download --no-binary :all: --no-deps "llama-cpp-python==$version" -d . -q
  tar xzf "llama_cpp_python-$version.tar.gz"
fi
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cd "$src"
if ! grep -q TBO_THREADS tests/test-backend-ops.cpp; then
  python - <<'EOF'
p = "tests/test-backend-ops.cpp"
s = open(p).read()
old = "#   define N_THREADS std::thread::hardware_concurrency()"
assert s.count(old) == 1, "test-backend-ops.cpp changed: N_THREADS"
s = s.replace(old, '#   define N_THREADS (getenv("TBO_THREADS") ? 2*atoi(getenv("TBO_THREADS")) : std::thread::hardware_concurrency())')
anchor = "    // Q4_K multi-column mat-vec\n"
assert s.count(anchor) == 1, "test-backend-ops.cpp changed: anchor"
s = s.replace(anchor, """    // jspec: out-of-cache shapes of the 1.5B target (gate x8 stacked)
    for (ggml_type ta : {GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_Q8_0}) {
        for (int bs : {1, 2, 3, 5, 9}) {
            test_cases.emplace_back(new test_mul_mat(ta, GGML_TYPE_F32, 71680, bs, 1536, {1, 1}, {1, 1}));
        }
    }
""" + anchor)
open(p, "w").write(s)
EOF
fi
if [ ! -x build/bin/test-backend-ops ]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=ON > "$work/cmake.log" 2>&1
  cmake --build build --target test-backend-ops -j"$(nproc)" >> "$work/cmake.log" 2>&1
fi
TBO_THREADS=${TBO_THREADS:-$(nproc)} ./build/bin/test-backend-ops perf -b CPU -o MUL_MAT -p 'm=71680' 2>&1 |
  grep MUL_MAT | sed 's/,k_v=.*runs -/ /;s/type_b=f32,//'
