#!/usr/bin/env bash
# sieve's Python module as its users install it (docs/PYTHON.md): a fresh
# virtual environment, `pip install ./python` (maturin builds the abi3
# wheel from this checkout), then the tests in python/tests with pytest on
# the default model, against the command line (built by scripts/setup.sh).
#
#   bash scripts/python-api.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/python-venv
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
start=$SECONDS
"$venv/bin/pip" install -q ./python
echo "python-api: pip install ./python took $((SECONDS - start)) s"
"$venv/bin/pip" install -q pytest
# Outside the checkout, so `import sieve` is the installed package.
(cd "$venv" && SIEVE_ROOT="$OLDPWD" bin/python -m pytest -q "$OLDPWD/python/tests")
