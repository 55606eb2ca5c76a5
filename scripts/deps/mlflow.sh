#!/usr/bin/env bash
# MLflow tracking server (PyPI `mlflow`) in its own venv, started by tests/integration/mlflow.rs on
# 127.0.0.1. Installed under ~/.cache/rtune-deps/mlflow (the path the tests look at); quick once present.
set -euo pipefail
venv="${XDG_CACHE_HOME:-$HOME/.cache}/rtune-deps/mlflow"
if [ ! -x "$venv/bin/mlflow" ]; then
  echo "deps: installing mlflow into $venv (a few minutes)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "mlflow==3.17.2"
fi
