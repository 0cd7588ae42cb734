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
# "libfoo.so.1 => /path/libfoo.so.1 (0x...)" and the loader's "/lib64/ld-linux-x86-64.so.2 (0x...)";
# not the "/path/to/binary:" header ldd prints before each binary's list when given several.
libs=$(ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $2 ~ /^\(0x/ {print $1}' | sort -u)
if [ -z "$libs" ]; then
  echo "runtime-packages.sh: ldd resolved no libraries for $*" >&2
  exit 1
fi

# owner_of LIB: the package(s) dpkg recorded for LIB, as "pkg1:amd64, pkg2: /path" lines.
owner_of() {
  # usrmerge: the loader may name /lib/... while dpkg recorded /usr/lib/... (or the reverse), and
  # the path may be a symlink (/usr/local/cuda -> cuda-13.0) recorded under its target.
  # An absolute path is matched exactly; an empty one would become "/usr", which every package owns.
  for path in "$1" "$(readlink -f "$1")"; do
    [ -n "$path" ] || continue
    for candidate in "$path" "/usr$path" "${path#/usr}"; do
      if [ "${candidate%/}" != "/usr" ] && dpkg-query -S "$candidate" 2>/dev/null; then
        return 0
      fi
    done
  done
  # Last resort: any recorded path ending in the same file name under a library directory.
  base=$(basename "$1")
  dpkg-query -S "$base" 2>/dev/null | grep -E "^[^:]+(:[a-z0-9]+)?(, [^:]+(:[a-z0-9]+)?)*: /(usr/)?lib[^ ]*/$base\$" | head -n 1 | grep .
}

# Collected in a variable, not a pipeline, so that a failure stops the script (a `for | sort`
# pipeline would run the loop in a subshell and lose its exit status).
packages=""
for lib in $libs; do
  if ! owner=$(owner_of "$lib"); then
    echo "runtime-packages.sh: no package owns $lib" >&2
    exit 1
  fi
  # "pkg1:amd64, pkg2: /path" -> pkg1 pkg2 (diversions list several).
  packages="$packages $(echo "$owner" | head -n 1 | sed 's/: \/.*//' | tr ',' ' ' | sed 's/:[a-z0-9]*//g')"
done
printf '%s\n' $packages | sort -u
