#!/usr/bin/env bash
# mypy over the installed namespace `switchyard`.
#
# Why a symlink farm: the repository's top-level folders become `switchyard.<part>` only at
# build time (setuptools package-dir in pyproject.toml), and mypy cannot follow that mapping
# (nor the editable install's import hook). So this builds the tree the wheel would have, as
# symlinks under .cache/typecheck/, and checks it with the [tool.mypy] settings in
# pyproject.toml. mypy reports the symlinks' paths; they are rewritten back to the real files,
# so `schemas/codec.py:12: error: ...` points where you edit.
#
# Usage: scripts/typecheck.sh [extra mypy arguments]   (exit status is mypy's)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mypy="${MYPY:-$root/.venv/bin/mypy}"
parts=(schemas scheduler workers ingress kvbus observability bench)  # keep in step with package-dir
farm=.cache/typecheck
pkg="$farm/switchyard"

rm -rf "$farm"
mkdir -p "$pkg"
for entry in switchyard/*; do  # the package's own modules: cli.py, up.py, models/, ...
    name="$(basename "$entry")"
    [[ "$name" == __pycache__ ]] && continue
    ln -s "$root/$entry" "$pkg/$name"
done
for part in "${parts[@]}"; do
    ln -s "$root/$part" "$pkg/$part"
done

# Map `.cache/typecheck/switchyard/<part>/` back to `<part>/`, and the rest to `switchyard/`.
rewrite=()
for part in "${parts[@]}"; do
    rewrite+=(-e "s#$farm/switchyard/$part/#$part/#g")
done
rewrite+=(-e "s#$farm/switchyard/#switchyard/#g")

set +e
"$mypy" --config-file pyproject.toml "$@" 2>&1 | sed "${rewrite[@]}"
status="${PIPESTATUS[0]}"
exit "$status"
