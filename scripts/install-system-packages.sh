#!/usr/bin/env bash
# Install the Debian packages named as arguments, only those missing (idempotent).
set -euo pipefail
if ! command -v dpkg-query >/dev/null; then
    echo "not a Debian system: install these with your package manager: $*" >&2
    exit 0
fi
missing=()
for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "==> installing Debian packages: ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
