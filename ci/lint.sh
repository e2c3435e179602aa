#!/usr/bin/env bash
# The formatter and linter checks CI runs (.ci/run): ruff over the Python (pyproject.toml's
# [tool.ruff]) and clang-format over the C++/CUDA (.clang-format). Fix with `ruff check --fix`
# and `clang-format -i FILE`.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
"$py" -m pip install -q "ruff==0.17.6" "clang-format==23.1.5"
"$py" -m ruff check python tests ci
scripts=$("$py" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
# shellcheck disable=SC2046
"$scripts/clang-format" --dry-run --Werror $(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh')
echo "lint: ruff and clang-format clean"
