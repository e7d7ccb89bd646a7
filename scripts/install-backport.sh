#!/bin/sh
# Install a Debian package at a version Debian 12 has only in its backports
# suite: scripts/install-backport.sh PACKAGE MIN-VERSION WHY
#   qemu-system-x86 1:10        the emulated KVM host (docs/SPEC.md, "Where
#                               microVMs run"): with 7.2 its kernel crashed
#   runsc 0.0~20240729          the gVisor backend (its checkpoints)
# The backports entry is made from the mirror this machine's apt already
# uses for bookworm, pinned below the release as backports always are, so
# only what is asked for here comes from it. Elsewhere the release's own
# package is taken, and a warning says when it is older than MIN. Nothing
# installed is removed: apt is told to fail rather than remove a package.
set -eu

pkg=$1
min=$2
why=$3
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo

have=$(dpkg-query -W -f='${Status} ${Version}' "$pkg" 2>/dev/null | sed -n 's/^install ok installed //p')
if [ -n "$have" ] && dpkg --compare-versions "$have" ge "$min"; then
	exit 0
fi

codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
target=""
if [ "$codename" = bookworm ]; then
	list=/etc/apt/sources.list.d/forkbox-bookworm-backports.list
	if [ ! -f "$list" ]; then
		mirror() { apt-get indextargets --format '$(REPO_URI)' 'Codename: bookworm' 'Origin: Debian' 'Created-By: Packages' | head -n1; }
		mirror=$(mirror)
		[ -n "$mirror" ] || { $SUDO apt-get update -q && mirror=$(mirror); }
		if [ -z "$mirror" ]; then
			echo "install-backport: no Debian bookworm mirror in this machine's apt sources; add bookworm-backports and install $pkg >= $min from it" >&2
			exit 1
		fi
		echo "install-backport: adding bookworm-backports from $mirror (for $pkg >= $min)"
		echo "deb $mirror bookworm-backports main" | $SUDO tee "$list" >/dev/null
	fi
	target="-t bookworm-backports"
fi

echo "install-backport: installing $pkg${have:+ (have $have)}${target:+ from bookworm-backports}"
$SUDO apt-get update -q
# shellcheck disable=SC2086
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends --no-remove $target "$pkg"
have=$(dpkg-query -W -f='${Version}' "$pkg")
if ! dpkg --compare-versions "$have" ge "$min"; then
	echo "install-backport: warning: $pkg $have is older than $min: $why" >&2
fi
