#!/usr/bin/env bash
# The Debian packages the tests need (tests/debian-packages.txt; docs/tests.md says what each is for).
# As root the missing ones are installed, named as they are; otherwise the one command that installs
# them is printed and this fails. A machine without dpkg is left to tests/conftest.py, which names each
# missing tool. DEBIAN_PACKAGES names another list (the tests of this script use one).
set -euo pipefail
list="${DEBIAN_PACKAGES:-$(dirname "$0")/debian-packages.txt}"
command -v dpkg-query >/dev/null || exit 0
missing=()
while read -r line; do
  pkg="${line%%#*}"
  pkg="${pkg//[[:space:]]/}"
  if [ -n "$pkg" ] && [ "$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null)" != "installed" ]; then
    missing+=("$pkg")
  fi
done <"$list"
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "the tests need Debian packages this machine lacks; install them as root: apt-get install -y --no-install-recommends ${missing[*]}" >&2
  exit 1
fi
echo "installing the Debian packages the tests need: ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
