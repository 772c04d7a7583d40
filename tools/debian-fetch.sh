#!/usr/bin/env bash
# Unpack Debian packages into a private folder, without installing them or touching the system:
#   tools/debian-fetch.sh SUITE DEST PKG...
# SUITE is a Debian release (bookworm, trixie); the packages' files land under DEST/root and the
# apt state this needs under DEST/apt. Used by `make install` for the tools the tests run for real
# (etcd for the etcd discovery test). Works as any user: apt's lists, cache and lock are private.
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 SUITE DEST PKG..." >&2
    exit 2
fi
suite=$1 dest=$2
shift 2
mkdir -p "$dest/apt/lists/partial" "$dest/apt/cache/archives/partial" "$dest/apt/debs" "$dest/root"
dest=$(cd "$dest" && pwd)
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
printf 'deb [signed-by=%s] http://deb.debian.org/debian %s main\n' "$keyring" "$suite" > "$dest/apt/sources.list"
opts=(-q -o "Dir::State::Lists=$dest/apt/lists" -o "Dir::Cache=$dest/apt/cache"
      -o "Dir::Etc::SourceList=$dest/apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
      -o "Debug::NoLocking=1" -o "APT::Sandbox::User=$(id -un)")
apt-get "${opts[@]}" update >/dev/null
cd "$dest/apt/debs"
apt-get "${opts[@]}" download "$@" >/dev/null
for deb in "$dest"/apt/debs/*.deb; do
    dpkg-deb -x "$deb" "$dest/root"
done
