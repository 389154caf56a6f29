#!/usr/bin/env bash
# Creates .venv with every dependency of embckpt. Idempotent: a complete .venv is left alone.
# torch, fbgemm and torchrec are pinned in scripts/requirements.txt (the '#@' lines, installed in
# stages) with torchrec's own dependencies; embckpt's dependencies and extras come from
# pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_browser.sh  # Chromium for tests/test_report.py (Debian's package)
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
REQ=scripts/requirements.txt
STAMP="$VENV/.embckpt-setup-$(sha1sum "$REQ" scripts/setup.sh pyproject.toml | sha1sum | cut -c1-12)"
[ -f "$STAMP" ] && exit 0

pin() { sed -n "s/^#@$1 //p" "$REQ"; }

"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install --disable-pip-version-check -q"
$PIP --upgrade pip wheel
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: CUDA found, installing CUDA builds"
  $PIP "$(pin torch)"
  $PIP "$(pin fbgemm-cuda)"
else
  echo "setup: no CUDA, installing CPU builds"
  $PIP "$(pin torch)"
  $PIP "$(pin fbgemm-cpu)"
fi
# torchrec's metadata requires the CUDA fbgemm-gpu: install it alone, then its real needs.
$PIP --no-deps "$(pin torchrec)"
$PIP -r "$REQ"
$PIP -e '.[plots,kmeans,sign,test]'
# numba compiles the codecs' kernels at their first call, minutes of CPU from a cold cache, in
# every process that finds them missing: compile them once, here, into numba's disk cache.
"$VENV/bin/python" -m embckpt.codecs.precompile
rm -f "$VENV"/.embckpt-setup-*
touch "$STAMP"
echo "setup: $VENV ready"
