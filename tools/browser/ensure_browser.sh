#!/usr/bin/env bash
# The browser of tests/server/test_status_page.py: Debian's chromium and chromium-driver (`make test`
# runs this). Installed where missing and this user may (root, apt-get); never fails the build:
# without a browser the test skips and says why.
set -u
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_browser: no Chromium, and installing it needs root and apt-get: the status page test will skip" \
       "(sudo apt-get install chromium chromium-driver)"
  exit 0
fi
echo "ensure_browser: installing Debian's chromium and chromium-driver for the status page test"
log=$(mktemp)
if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium chromium-driver) >"$log" 2>&1; then
  rm -f "$log"
else
  echo "ensure_browser: apt-get could not install Chromium (the status page test will skip):"
  tail -n 5 "$log"
  rm -f "$log"
fi
exit 0
