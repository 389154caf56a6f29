#!/usr/bin/env bash
# Installs the headless browser that tests/test_report.py renders the report page in: Debian's
# chromium package (Playwright's own browser download is not used). Returns at once when a
# Chromium is already on PATH or EMBCKPT_CHROMIUM names one. Where apt-get cannot be used
# (not Debian, not root and no password-less sudo), it says how to install one and returns 0:
# the rest of the setup still runs, and that test fails with the same instructions.
set -euo pipefail
for name in "${EMBCKPT_CHROMIUM:-}" chromium chromium-browser google-chrome google-chrome-stable; do
  if [ -n "$name" ] && command -v "$name" >/dev/null 2>&1; then
    exit 0
  fi
done
if [ "$EUID" -eq 0 ]; then
  SUDO=
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  SUDO=none
fi
if ! command -v apt-get >/dev/null 2>&1 || [ "$SUDO" = none ]; then
  echo "install_browser: no Chromium and no usable apt-get: install chromium with your package" \
    "manager, or set EMBCKPT_CHROMIUM to a Chromium binary (tests/test_report.py needs it)" >&2
  exit 0
fi
echo "install_browser: installing Debian's chromium for the report page test"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
command -v chromium >/dev/null
echo "install_browser: $(chromium --version 2>/dev/null)"
