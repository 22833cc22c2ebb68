#!/usr/bin/env bash
# Best effort: the default evaluation corpus is Debian's python3-doc plus /usr/share/common-licenses.
# Installs python3-doc where apt-get can (root on Debian/Ubuntu); elsewhere the harness falls back to
# the standard library's docstrings and says so. Never fails the caller.
if ls -d /usr/share/doc/python3*/html/_sources >/dev/null 2>&1; then exit 0; fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-doc) >/dev/null 2>&1 \
    || echo "setup_text: could not install python3-doc; the harness will use its fallback corpus" >&2
fi
exit 0
