#!/bin/sh
# runtime-packages.sh BINARY...: prints, one per line and sorted, the Debian/Ubuntu packages that
# own the shared libraries the binaries load (as ldd resolves them on this system).
#
# The images run it in their build stage and install exactly that list in the runtime stage, so
# the runtime carries the libraries the binaries were linked against (gRPC, protobuf, Abseil,
# prometheus-cpp, civetweb, and with CUDA cudart/cuBLAS/NCCL) whatever their package names are
# on the base distribution (Ubuntu 24.04's t64 names differ from Debian 12's).
# Fails when a library is missing or owned by no package: the runtime stage could not supply it.
set -eu
if [ "$#" -eq 0 ]; then
  echo "usage: runtime-packages.sh BINARY..." >&2
  exit 2
fi
missing=$(ldd "$@" | grep 'not found' || true)
if [ -n "$missing" ]; then
  echo "runtime-packages.sh: unresolved libraries:" >&2
  echo "$missing" >&2
  exit 1
fi
# "libfoo.so.1 => /path/libfoo.so.1 (0x...)" and the loader's "/lib64/ld-linux-x86-64.so.2 (0x...)".
libs=$(ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | sort -u)
for lib in $libs; do
  owner=""
  # usrmerge: the loader may name /lib/... while dpkg recorded /usr/lib/... (or the reverse), and
  # the path may be a symlink (/usr/local/cuda -> cuda-13.0) recorded under its target.
  for path in "$lib" "$(readlink -f "$lib")"; do
    for candidate in "$path" "/usr$path" "${path#/usr}"; do
      if owner=$(dpkg-query -S "$candidate" 2>/dev/null); then
        break 2
      fi
      owner=""
    done
  done
  if [ -z "$owner" ]; then
    echo "runtime-packages.sh: no package owns $lib" >&2
    exit 1
  fi
  # "pkg1:amd64, pkg2: /path" -> pkg1 pkg2 (diversions list several).
  echo "$owner" | head -n 1 | sed 's/: \/.*//' | tr ',' '\n' | sed 's/^ *//; s/:.*//'
done | sort -u
