#!/usr/bin/env bash
# On the device: keep this chunk's files in $HOME/vNN-stage (it survives while the machine stays warm).
set -e; here="$(dirname "$0")"; stage=$HOME/v$(cat "$here/RELEASE")-stage
mkdir -p "$stage"; cp "$here"/* "$stage"/
missing=$(cd "$stage" && while read -r f; do [ -e "$f" ] || echo "$f"; done < MANIFEST | wc -l)
echo "stashed $(basename "$here"); files still missing: $missing"
