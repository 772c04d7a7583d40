#!/usr/bin/env bash
# Unpack Debian trixie's CRIU (4.1.1) with every library it loads, its own glibc and loader
# included, into DEST, and write WRAPPER, a script that runs it:
#   tools/criu-fetch.sh DEST WRAPPER        (make install: .venv/criu and .venv/bin/criu)
# Why trixie's and why its own loader: bookworm's CRIU 3.17 fails `criu check` on recent kernels
# (vDSO), and trixie's binaries need a newer glibc than Debian 12's. Run through the unpacked
# ld.so with --library-path, CRIU loads nothing from the host, so one wrapper serves Debian 12 and
# newer hosts (Ubuntu 24.04) alike. --library-path, unlike LD_LIBRARY_PATH, is not inherited by
# the programs CRIU runs (action scripts, iptables). Nothing is installed system-wide.
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: $0 DEST WRAPPER" >&2
    exit 2
fi
dest=$1 wrapper=$2
here=$(cd "$(dirname "$0")" && pwd)
case $(uname -m) in
x86_64) triplet=x86_64-linux-gnu ;;
aarch64) triplet=aarch64-linux-gnu ;;
*) echo "$0: no Debian multiarch name known for $(uname -m)" >&2; exit 2 ;;
esac
"$here/debian-fetch.sh" trixie "$dest" \
    criu libcompel1 libnet1 libnftables1 libnl-3-200 libprotobuf-c1 libbsd0 libmd0 libnftnl11 libmnl0 \
    libjansson4 libxtables12 \
    libc6 libgnutls30t64 libnettle8t64 libhogweed6t64 libgmp10 libp11-kit0 libtasn1-6 libunistring5 \
    libidn2-0 libffi8 libuuid1
root=$(cd "$dest/root" && pwd)
loader=$(ls "$root/usr/lib/$triplet"/ld-linux*.so.* | head -n1)
# Plugins from here only (none: trixie ships none, and CUDA processes need none), never a host
# CRIU's /usr/lib/criu, built for another CRIU and glibc.
mkdir -p "$(dirname "$wrapper")" "$root/usr/lib/criu"
# Paths relative to the wrapper's own folder: a copied venv (cp -a .venv) keeps a working criu.
rel=$(realpath --relative-to="$(cd "$(dirname "$wrapper")" && pwd)" "$root")
cat > "$wrapper" <<EOF
#!/bin/sh
# Trixie's CRIU through its own loader and libraries (written by tools/criu-fetch.sh).
root="\$(cd "\$(dirname "\$(readlink -f "\$0")")" && pwd)/$rel"
lib="\$root/usr/lib/$triplet"
exec "\$lib/$(basename "$loader")" --library-path "\$lib" "\$root/usr/sbin/criu" --libdir "\$root/usr/lib/criu" "\$@"
EOF
chmod +x "$wrapper"
