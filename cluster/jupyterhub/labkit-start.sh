#!/usr/bin/env bash
# The first process of every course server on Kubernetes (values.yaml: singleuser.cmd), installed in
# the image as /usr/local/bin/labkit-start. The pod starts as root for this script only. It gives the
# person the hub named (NB_USER) the uid the hub gave them (NB_UID), so that nbgrader's shared
# exchange keeps students apart by file ownership, as the unix users of `make hub` do:
#   - a passwd entry for them, and one for each person in LABKIT_PEOPLE ("name:uid,..."): an
#     instructor's server lists everyone, so `nbgrader collect` can name each submission's owner;
#   - their home made theirs (mode 700, and what is in it: a uid changes with a new hub database),
#     the exchange's root sticky and writable by all, and on an instructor's server
#     (LABKIT_INSTRUCTOR=1) the course's folder in it theirs before any student can make it theirs;
#   - then root dropped for good (setpriv: their uid, group users, no capabilities, no new
#     privileges), the labs' student form copied into ~/labs (cp -n: a student's work is never
#     overwritten) and COMMAND started.
# Started as any other user (docker run, a training pod), it only copies the labs and starts COMMAND.
#   labkit-start jupyterhub-singleuser
set -euf # -f: no globbing of what the hub passes
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

# taken NAME UID: "name:uid" of the entry with that name or that uid, if any (looked up by field:
# getent would read an all-digit name as a uid)
taken() { awk -F: -v n="$1" -v u="$2" '$1 == n || $3 == u { print $1 ":" $3; exit }' /etc/passwd; }
# add NAME UID: 0 if NAME is now UID's entry, 1 if the name or the uid belongs to someone else
add() {
  case $(taken "$1" "$2") in
    "$1:$2") return 0 ;;
    "") echo "$1:x:$2:$GID::$HOME_DIR:/bin/bash" >>/etc/passwd ;;
    *) return 1 ;;
  esac
}
add "$NB_USER" "$NB_UID" || die "the image already has a user named $NB_USER or with uid $NB_UID ($(taken "$NB_USER" "$NB_UID")); that login cannot have a server"
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
# -xdev: the home volume only; -h: a link itself, never what it points to
find "$HOME_DIR" -xdev ! -uid "$NB_UID" -exec chown -h "$NB_UID:$GID" {} + && chmod 700 "$HOME_DIR" \
  || echo "labkit-start: could not make $HOME_DIR $NB_USER's (a volume that squashes root?): their work may not save" >&2
# Sticky, as /tmp: nobody renames or removes what another put there (the course's folder included).
# Root on an NFS export with root_squash may not chmod: then the export's owner does it once.
if [ -d "$EXCHANGE" ] && [ "$(stat -c %a "$EXCHANGE")" != 1777 ]; then
  chmod 1777 "$EXCHANGE" || echo "labkit-start: could not make $EXCHANGE writable by all and sticky (chmod 1777); do it once where the volume is served" >&2
fi
COURSE=$EXCHANGE/${NBGRADER_COURSE_ID:-training-at-scale}
if [ "${LABKIT_INSTRUCTOR:-}" = 1 ] && [ -d "$EXCHANGE" ]; then
  if [ ! -e "$COURSE" ]; then
    install -d -o "$NB_UID" -g "$GID" -m 755 "$COURSE" \
      || echo "labkit-start: could not make $COURSE $NB_USER's (a volume that squashes root?): create it once where the volume is served, owned by uid $NB_UID" >&2
  elif [ "$(stat -c %u "$COURSE")" != "$NB_UID" ]; then
    echo "labkit-start: $COURSE belongs to uid $(stat -c %u "$COURSE"), not $NB_USER: if that is not an instructor, a student made it before the first release; remove it as root (kubectl exec into this pod)" >&2
  fi
fi

exec setpriv --reuid="$NB_UID" --regid="$GID" --clear-groups --inh-caps=-all --no-new-privs \
  env HOME="$HOME_DIR" USER="$NB_USER" LOGNAME="$NB_USER" SHELL=/bin/bash sh -c "$COPY" "$LABS" "$@"
