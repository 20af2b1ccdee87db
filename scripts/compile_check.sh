#!/usr/bin/env bash
# Compiles every C++ source of the extension against another torch's headers, without linking
# (-fsyntax-only): the check that the sources still build on a torch we do not install here
# (the lent GPU machine has torch 2.11). Takes the flags of an existing build tree.
#
#   scripts/compile_check.sh 2.11.0            # downloads that torch's wheel from PyPI (no deps)
#   scripts/compile_check.sh /path/to/torch    # a torch package directory (holding include/)
#
# BUILD=build/py311-torch2.14.1 by default (scripts/setup.sh makes it). JOBS=2.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:?usage: scripts/compile_check.sh TORCH_VERSION|TORCH_DIR}
build=${BUILD:-$(ls -d build/py311-torch* 2>/dev/null | sort -V | tail -1)}
[ -f "$build/build.ninja" ] || { echo "no build tree at '$build': run scripts/setup.sh first" >&2; exit 2; }
if [ -d "$target" ]; then
  torch_dir=$(cd "$target" && pwd)
else
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/resilient_comm/torch-$target
  if [ ! -d "$cache/torch/include" ]; then
    mkdir -p "$cache"
    echo "downloading torch==$target's wheel (headers only are kept) ..."
    python3 -m pip download --quiet --no-deps "torch==$target" -d "$cache/wheel"
    unzip -q -o "$cache"/wheel/torch-*.whl 'torch/include/*' 'torch/version.py' -d "$cache"
    rm -rf "$cache/wheel"
  fi
  torch_dir=$cache/torch
fi
version=$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$torch_dir/version.py" 2>/dev/null || echo unknown)
current=$(grep -o -m1 -- '-isystem [^ ]*/torch/include ' "$build/build.ninja" | awk 'NR == 1 {print $2}')
current=${current%/include}
echo "compiling the sources of $build against torch $version ($torch_dir)"
# Each compile command (the extension, its C++ tests and benchmarks), its torch include paths pointed at the other torch,
# its output dropped.
(cd "$build" && ninja -t commands) | grep -E ' -c [^ ]+\.cpp$' |
  sed -e "s#$current#$torch_dir#g" -e 's# -o [^ ]*# -fsyntax-only#' -e 's# -MD -MT [^ ]* -MF [^ ]*##' \
  > /tmp/rc-compile-check.$$
n=$(wc -l < /tmp/rc-compile-check.$$)
fails=0
xargs -P "${JOBS:-2}" -I{} bash -c '{} 2>&1 || { echo "FAILED: {}" | grep -o "[^ ]*\.cpp$"; exit 1; }' \
  < /tmp/rc-compile-check.$$ || fails=1
rm -f /tmp/rc-compile-check.$$
if [ "$fails" = 0 ]; then
  echo "ok: $n sources compile against torch $version"
else
  echo "some of $n sources do not compile against torch $version (above)" >&2
  exit 1
fi
