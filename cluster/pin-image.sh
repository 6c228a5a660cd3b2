#!/usr/bin/env bash
# Pin the course image by digest everywhere it is used, once it is pushed: a tag can be pushed
# again, a digest cannot, so every pod (a training pod replaced after a preemption, a student's
# server started a week later) runs the same bytes as its peers.
#
#   bash cluster/pin-image.sh ghcr.io/training-at-scale/labkit:0.1.0
#
# It asks the registry for the image's digest (`docker buildx imagetools inspect`; set DIGEST to
# give it yourself) and rewrites cluster/k8s/base/kustomization.yaml (digest: sha256:...) and
# cluster/jupyterhub/values.yaml (tag: "0.1.0@sha256:..."). KUSTOMIZATION and VALUES name other files.
set -euo pipefail
die() { echo "pin-image.sh: $*" >&2; exit 2; }

[ $# -eq 1 ] || die "usage: bash cluster/pin-image.sh REGISTRY/NAME:TAG (the image you pushed)"
IMAGE=$1
case "$IMAGE" in
  *@*) die "IMAGE=$IMAGE already names a digest; give the tag you pushed, e.g. ghcr.io/org/labkit:0.1.0" ;;
  *:latest) die "IMAGE=$IMAGE: 'latest' moves; push and pin a version tag" ;;
  */*:*) ;;
  *) die "IMAGE=$IMAGE must be REGISTRY/NAME:TAG, e.g. ghcr.io/training-at-scale/labkit:0.1.0" ;;
esac
NAME=${IMAGE%:*}
TAG=${IMAGE##*:}
HERE=$(cd "$(dirname "$0")" && pwd)
KUSTOMIZATION=${KUSTOMIZATION:-$HERE/k8s/base/kustomization.yaml}
VALUES=${VALUES:-$HERE/jupyterhub/values.yaml}

if [ -z "${DIGEST:-}" ]; then
  command -v docker >/dev/null || die "docker is not on PATH: install it, or pass DIGEST=sha256:..."
  DIGEST=$(docker buildx imagetools inspect "$IMAGE" --format '{{json .Manifest.Digest}}' | tr -d '"') \
    || die "could not read the digest of $IMAGE from its registry (is it pushed? are you logged in?)"
fi
[[ "$DIGEST" =~ ^sha256:[0-9a-f]{64}$ ]] || die "DIGEST=$DIGEST is not sha256: followed by 64 hex digits"

python3 - "$KUSTOMIZATION" "$VALUES" "$NAME" "$TAG" "$DIGEST" <<'PY'
import re
import sys
from pathlib import Path

kust, values, name, tag, digest = sys.argv[1:]
k = Path(kust).read_text()
new = re.sub(r"(  - name: labkit\n    newName: )\S+\n    newTag: \S+\n(    digest: \S+\n)?",
             rf'\g<1>{name}\n    newTag: "{tag}"\n    digest: {digest}\n', k)
if new == k and f"digest: {digest}" not in k:
    sys.exit(f"pin-image.sh: no 'name: labkit' image entry in {kust}")
Path(kust).write_text(new)
v = Path(values).read_text()
# the servers' image (singleuser.image), not the hub's (hub.image: labkit-hub)
new = re.sub(r"(  image:\n    name: )(\S+/)?labkit\n    tag: \S+\n", rf'\g<1>{name}\n    tag: "{tag}@{digest}"\n', v)
if new == v and f"{tag}@{digest}" not in v:
    sys.exit(f"pin-image.sh: no singleuser image name/tag in {values}")
Path(values).write_text(new)
print(f"pinned {name}:{tag} at {digest} in {kust} and {values}")
PY
