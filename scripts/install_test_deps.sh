#!/usr/bin/env bash
# Debian packages only the tests need: chromium, which loads the router's live page
# (tests/e2e/test_dashboard.py). Idempotent: does nothing when present. `make test` runs it best
# effort; without chromium that one test skips and says why.
set -euo pipefail
command -v chromium >/dev/null 2>&1 && exit 0
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
