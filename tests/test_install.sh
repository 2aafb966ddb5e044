#!/usr/bin/env bash
# Install test (CTest: host_install): `cmake --install BUILD_DIR --prefix <scratch>`, then build
# examples/hello.c against the installed copy twice, as a user would: with
# `pkg-config --cflags --libs pinmem`, and with a small CMake project that calls
# find_package(pinmem) (shared and static targets), then again with the CUDA toolkit hidden
# (the shared library must need none). Every program built must run and say it copied its
# bytes, and the installed tool and the pkg-config program must run without LD_LIBRARY_PATH.
# Nothing outside the scratch folder is touched.
set -euo pipefail

usage="usage: test_install.sh SOURCE_DIR BUILD_DIR"
src=${1:?$usage}
build=${2:?$usage}
src=$(cd "$src" && pwd)
build=$(cd "$build" && pwd)
hello=$src/examples/hello.c

tmp=$(mktemp -d "${TMPDIR:-/tmp}/pinmem-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

die() {
  echo "test_install: FAIL: $*" >&2
  exit 1
}
# quiet LOGNAME CMD...: run CMD with its output in a log that is printed only if it fails.
quiet() {
  local log=$tmp/$1.log
  shift
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    die "command failed: $*"
  fi
}
expect_hello() { # NAME CMD...
  local name=$1
  shift
  local out
  out=$("$@" 2>&1) || die "$name: exit status $?: $out"
  [[ $out == "copied 1048576 bytes to the device ("*" backend)" ]] ||
    die "$name: unexpected output: $out"
  echo "  $name: $out"
}

# The README's C block (its first) is examples/hello.c as it is.
if [[ -f $src/README.md ]]; then
  awk '/^```c$/ {c = 1; next} c && /^```$/ {exit} c {print}' \
    "$src/README.md" >"$tmp/readme_example.c"
  cmp -s "$tmp/readme_example.c" "$hello" ||
    die "the C example in README.md differs from examples/hello.c: $(diff "$tmp/readme_example.c" "$hello" | head -5)"
fi

echo "== cmake --install $build --prefix $prefix"
quiet install cmake --install "$build" --prefix "$prefix"

# What must be there.
[[ -f $prefix/include/pinmem.h ]] || die "include/pinmem.h not installed"
[[ -x $prefix/bin/pinmem ]] || die "bin/pinmem not installed"
pc=$(find "$prefix" -name pinmem.pc -path '*/pkgconfig/*' -print -quit)
[[ -n $pc ]] || die "pinmem.pc not installed"
cfg=$(find "$prefix" -name pinmemConfig.cmake -print -quit)
[[ -n $cfg ]] || die "pinmemConfig.cmake not installed"
libdir=$(dirname "$(dirname "$pc")")
[[ -f $libdir/libpinmem.a ]] || die "libpinmem.a not in $libdir"
compgen -G "$libdir/libpinmem.so*" >/dev/null || die "libpinmem.so not in $libdir"
[[ ! -e $prefix/include/internal.h && ! -e $prefix/include/backend.h ]] ||
  die "internal headers were installed"

"$prefix/bin/pinmem" --version | grep -Eq '^pinmem [0-9]+\.[0-9]+\.[0-9]+$' ||
  die "installed pinmem --version does not print its version"
# The installed tool starts as a user starts it, with no LD_LIBRARY_PATH.
out=$(env -u LD_LIBRARY_PATH "$prefix/bin/pinmem" info 2>&1) ||
  die "installed pinmem info without LD_LIBRARY_PATH: exit status $?: $(head -n 5 <<<"$out")"
echo "  installed pinmem info (no LD_LIBRARY_PATH): $(head -n 1 <<<"$out")"

cc=${CC:-cc}

# ---- pkg-config --------------------------------------------------------------------------------
command -v pkg-config >/dev/null ||
  die "pkg-config is not installed (Debian: apt-get install pkg-config; make test installs it)"
export PKG_CONFIG_PATH=${pc%/*}
cflags=$(pkg-config --cflags pinmem) || die "pkg-config --cflags pinmem failed"
libs=$(pkg-config --libs pinmem) || die "pkg-config --libs pinmem failed"
echo "== pkg-config: cflags '$cflags' libs '$libs'"
# The flags must name this installation, wherever it was installed with --prefix.
# has_dir FLAG FLAGS DIR: one of FLAGS is FLAG<a path that resolves to DIR>.
has_dir() {
  local f want
  want=$(realpath -m "$3")
  for f in $2; do
    [[ $f == "$1"* ]] && [[ $(realpath -m "${f#"$1"}") == "$want" ]] && return 0
  done
  return 1
}
has_dir -I "$cflags" "$prefix/include" ||
  die "pkg-config --cflags gives '$cflags', not -I$prefix/include (pinmem.pc does not follow the install prefix)"
has_dir -L "$libs" "$libdir" ||
  die "pkg-config --libs gives '$libs', not -L$libdir (pinmem.pc does not follow the install prefix)"
has_dir -Wl,-rpath, "$libs" "$libdir" ||
  die "pkg-config --libs gives '$libs', without -Wl,-rpath,$libdir (programs would need LD_LIBRARY_PATH)"
# shellcheck disable=SC2086
quiet cc_pc "$cc" -std=c11 -Wall -Wextra -Werror -o "$tmp/hello_pc" "$hello" $cflags $libs
# As the documented recipe promises: it starts with no LD_LIBRARY_PATH, and the library it
# loads is the one just installed.
expect_hello "pkg-config build (no LD_LIBRARY_PATH)" env -u LD_LIBRARY_PATH "$tmp/hello_pc"
if command -v ldd >/dev/null; then
  so=$(env -u LD_LIBRARY_PATH ldd "$tmp/hello_pc" | awk '$1 ~ /^libpinmem\.so/ {print $3}')
  [[ -n $so && $(realpath "$so") == $(realpath "$libdir")/* ]] ||
    die "the pkg-config build loads libpinmem from '$so', not from $libdir"
fi

# ---- CMake find_package ------------------------------------------------------------------------
mkdir -p "$tmp/consumer"
cat >"$tmp/consumer/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.18)
project(pinmem_consumer LANGUAGES C)
find_package(pinmem 0.1 REQUIRED)
add_executable(hello_shared ${HELLO})
target_link_libraries(hello_shared PRIVATE pinmem::pinmem)
add_executable(hello_static ${HELLO})
target_link_libraries(hello_static PRIVATE pinmem::pinmem_static)
CMAKE
echo "== find_package(pinmem) with CMAKE_PREFIX_PATH=$prefix"
quiet consumer_configure cmake -S "$tmp/consumer" -B "$tmp/consumer/build" \
  -DCMAKE_PREFIX_PATH="$prefix" -DHELLO="$hello" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS="-Wall -Wextra -Werror"
grep -q "pinmem_DIR:PATH=$prefix/" "$tmp/consumer/build/CMakeCache.txt" ||
  die "find_package(pinmem) found another installation: $(grep pinmem_DIR "$tmp/consumer/build/CMakeCache.txt")"
quiet consumer_build cmake --build "$tmp/consumer/build"
expect_hello "CMake build, pinmem::pinmem" "$tmp/consumer/build/hello_shared"
expect_hello "CMake build, pinmem::pinmem_static" "$tmp/consumer/build/hello_static"
if command -v ldd >/dev/null && ldd "$tmp/consumer/build/hello_static" | grep -q libpinmem; then
  die "hello_static links libpinmem dynamically"
fi

# ---- find_package(pinmem) without the CUDA toolkit ---------------------------------------------
# Neither library links anything of a toolkit: both must work where it is absent.
mkdir -p "$tmp/nocuda"
cat >"$tmp/nocuda/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.18)
project(pinmem_nocuda LANGUAGES C)
find_package(pinmem 0.1 REQUIRED)
add_executable(hello_shared ${HELLO})
target_link_libraries(hello_shared PRIVATE pinmem::pinmem)
if(TARGET pinmem::pinmem_static)
  add_executable(hello_static ${HELLO})
  target_link_libraries(hello_static PRIVATE pinmem::pinmem_static)
endif()
if(WANT_STATIC)
  find_package(pinmem 0.1 REQUIRED COMPONENTS static)
endif()
CMAKE
nocuda=(-DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON -DCMAKE_PREFIX_PATH="$prefix"
  -DHELLO="$hello" -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="-Wall -Wextra -Werror")
echo "== find_package(pinmem) with the CUDA toolkit hidden (CMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit)"
quiet nocuda_configure cmake -S "$tmp/nocuda" -B "$tmp/nocuda/build" "${nocuda[@]}"
quiet nocuda_build cmake --build "$tmp/nocuda/build"
expect_hello "CMake build without the toolkit, pinmem::pinmem" "$tmp/nocuda/build/hello_shared"
# The cuda backend loads the driver at run time: the static library needs no toolkit either.
expect_hello "CMake build without the toolkit, pinmem::pinmem_static" \
  "$tmp/nocuda/build/hello_static"

echo "test_install: passed"
