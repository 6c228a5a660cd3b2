#!/usr/bin/env bash
# The first process of every course server on Kubernetes (values.yaml: singleuser.cmd), installed in
# the image as /usr/local/bin/labkit-start. The pod starts as root for this script only. It gives the
# person the hub named (NB_USER) the uid the hub gave them (NB_UID), so that nbgrader's shared
# exchange keeps students apart by file ownership, as the unix users of `make hub` do:
#   - a passwd entry for them, and one for each person in LABKIT_PEOPLE ("name:uid,..."): an
#     instructor's server lists everyone, so `nbgrader collect` can name each submission's owner;
#   - their home made theirs (chown, mode 700), and the exchange's root sticky and writable by all;
#   - then root dropped for good (setpriv: their uid, group users, no capabilities, no new
#     privileges), the labs' student form copied into ~/labs (cp -n: a student's work is never
#     overwritten) and COMMAND started.
# Started as any other user (docker run, a training pod), it only copies the labs and starts COMMAND.
#   labkit-start jupyterhub-singleuser
set -eu
die() { echo "labkit-start: $*" >&2; exit 2; }
[ $# -gt 0 ] || die "usage: labkit-start COMMAND [ARG...] (the server to start, e.g. jupyterhub-singleuser)"
LABS=${LABKIT_STUDENT_LABS:-/opt/labkit/student-labs}
EXCHANGE=${NBGRADER_EXCHANGE:-/srv/nbgrader/exchange}
GID=100 # users
# the labs, as the person: run by sh -c below with $0 = LABS and the command after it
# shellcheck disable=SC2016 # expanded by that sh, as the person
COPY='mkdir -p "$HOME/labs" && cp -n "$0"/*.ipynb "$HOME/labs/" || echo "labkit-start: not every lab was copied into $HOME/labs" >&2; exec "$@"'

if [ "$(id -u)" != 0 ]; then
  exec sh -c "$COPY" "$LABS" "$@"
fi

name_ok() { case $1 in "" | [!a-z0-9]* | *[!a-z0-9._-]*) return 1 ;; esac; }
uid_ok() { case $1 in "" | *[!0-9]*) return 1 ;; esac; [ "$1" -ge 1000 ]; }
name_ok "${NB_USER:-}" || die "NB_USER='${NB_USER:-}' is not a user name (lower-case letters, digits, '.', '_', '-'); the hub sets it"
uid_ok "${NB_UID:-}" || die "NB_UID='${NB_UID:-}' must be a number of at least 1000; the hub sets it (10000 + the person's id)"
HOME_DIR=${NB_HOME:-/home/jovyan} # the home volume's mount point (singleuser.storage.homeMountPath)

# add NAME UID: 0 if NAME is now UID's entry, 1 if the name or the uid belongs to someone else
add() {
  by_name=$(getent passwd "$1" | cut -d: -f3) || true
  by_uid=$(getent passwd "$2" | cut -d: -f1) || true
  [ "$by_name" = "$2" ] && return 0
  [ -z "$by_name" ] && [ -z "$by_uid" ] || return 1
  echo "$1:x:$2:$GID::$HOME_DIR:/bin/bash" >>/etc/passwd
}
add "$NB_USER" "$NB_UID" || die "the image already has a user named $NB_USER or with uid $NB_UID: $(getent passwd "$NB_USER" "$NB_UID" | head -1)"
old_ifs=$IFS
IFS=,
for person in ${LABKIT_PEOPLE:-}; do
  name=${person%%:*} uid=${person#*:}
  if ! name_ok "$name" || ! uid_ok "$uid" || ! add "$name" "$uid"; then
    echo "labkit-start: LABKIT_PEOPLE: '$person' left out (not name:uid, or the name or uid is taken)" >&2
  fi
done
IFS=$old_ifs

mkdir -p "$HOME_DIR"
chown "$NB_UID:$GID" "$HOME_DIR"
chmod 700 "$HOME_DIR"
# Sticky, as /tmp: nobody renames or removes what another put there (the course's folder included).
# Root on an NFS export with root_squash may not chmod: then the export's owner does it once.
if [ -d "$EXCHANGE" ] && [ "$(stat -c %a "$EXCHANGE")" != 1777 ]; then
  chmod 1777 "$EXCHANGE" || echo "labkit-start: could not make $EXCHANGE writable by all and sticky (chmod 1777); do it once where the volume is served" >&2
fi

exec setpriv --reuid="$NB_UID" --regid="$GID" --clear-groups --inh-caps=-all --no-new-privs \
  env HOME="$HOME_DIR" USER="$NB_USER" LOGNAME="$NB_USER" SHELL=/bin/bash sh -c "$COPY" "$LABS" "$@"
