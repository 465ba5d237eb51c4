#!/usr/bin/env bash
# Create ./.venv with everything miles needs (CPU build of torch from local disk), once.
# Re-running is cheap: pip skips what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -s .ci/apt-packages.txt ] && command -v apt-get >/dev/null; then
  missing=$(while read -r p; do [ -n "$p" ] && ! dpkg -s "$p" >/dev/null 2>&1 && echo "$p"; done < .ci/apt-packages.txt || true)
  if [ -n "$missing" ]; then
    apt-get update -qq && apt-get install -y -qq $missing >/dev/null
  fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
