"""nbgrader's ``collect``, taking each student's own submission, as data.

nbgrader files a submission under the name its submitter claims (``nbgrader submit --student=alice``
claims Alice's), collects the newest one per name, and only logs "cheating attempt?" when the folder's
owner is someone else (``nbgrader/exchange/default/collect.py``). It then copies the folder with
``shutil.copytree``, as the instructor, following links: a link to the source notebook collected
the solution, a link to ``/dev/zero`` copied until a ulimit stopped it, and a FIFO stopped the whole
collect with a traceback. A submission folder also stays writable by its student, with a timestamp
the student wrote.

:class:`OwnedCollect` therefore:

* leaves out every submission whose folder (``lstat``: not through a link) is not a folder owned by
  the person it is filed under, and says so;
* copies only regular files owned by that student, each opened with ``O_NOFOLLOW | O_NONBLOCK`` and
  checked on the open descriptor (a name swapped for a link between check and open cannot fool it),
  each under ``CourseDirectory.max_file_size`` and all under ``max_dir_size``; links, FIFOs,
  sockets, devices, someone else's files and what is too large are left out and logged for that
  student alone; a student whose copy fails is reported and the others are still collected;
* dates a submission by the last change of any of its files (``st_ctime``, which no user can set)
  when that is later than the time its student wrote: a submission edited after the deadline counts
  as late.

The course directory's ``nbgrader_config.py``, the hub image's and ``make hub``'s per-role settings
name it, so the formgrader collects with it too.
"""
from __future__ import annotations

import datetime
import fnmatch
import os
import pwd
import shutil
import stat

from nbgrader.exchange.default.collect import ExchangeCollect

SLACK_S = 120  # nbgrader's own copy at submit time: ctimes a little after the written timestamp
MAX_DEPTH = 16


def _owner(st: os.stat_result) -> str:
    try:
        return pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        return "unknown id"


def _kind(mode: int) -> str:
    return ("a link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")


class OwnedCollect(ExchangeCollect):
    """Collect only what each student owns, as data (see the module)."""

    def _sort_by_timestamp(self, records: list[dict]) -> list[dict]:
        owned = []
        for record in records:
            try:
                st = os.lstat(os.path.join(self.inbound_path, record["filename"]))
            except OSError:
                continue
            owner = _owner(st)
            if stat.S_ISDIR(st.st_mode) and owner == record["username"]:
                owned.append(record)
            else:
                what = "owned by " + owner if stat.S_ISDIR(st.st_mode) else _kind(st.st_mode)
                self.log.warning("Left out %s: filed under %s but %s", record["filename"], record["username"], what)
        # nbgrader takes the first record of every name: for a name with none of its own, a marker
        # that copy_files drops
        return super()._sort_by_timestamp(owned) or [{**records[0], "left_out": True}]

    def copy_files(self) -> None:
        self.src_records = [r for r in self.src_records if not r.get("left_out")]
        super().copy_files()

    def do_copy(self, src: str, dest: str, log=None) -> None:
        """Copy the submission ``src`` to ``dest`` as data; a failure is this student's alone."""
        student = os.path.basename(src).rsplit("+", 3)[0]
        try:
            uid = pwd.getpwnam(student).pw_uid
        except KeyError:
            uid = os.lstat(src).st_uid  # no unix user of that name (a hub with other logins): its owner
        self._budget = self.coursedir.max_dir_size * 1000
        self._last_change = 0.0
        try:
            os.makedirs(dest)
            self._copy_folder(src, dest, uid, student, depth=0)
            self._date(dest, student)
        except OSError as e:
            shutil.rmtree(dest, ignore_errors=True)
            self.log.error("Not collected: %s's submission %s (%s)", student, os.path.basename(src), e)

    def _copy_folder(self, src: str, dest: str, uid: int, student: str, depth: int) -> None:
        st = os.lstat(src)
        self._last_change = max(self._last_change, st.st_ctime)
        if depth > MAX_DEPTH:
            raise OSError(f"folders nested deeper than {MAX_DEPTH}")
        with os.scandir(src) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if any(fnmatch.fnmatch(entry.name, g) for g in self.coursedir.ignore):
                    continue
                path, to = os.path.join(src, entry.name), os.path.join(dest, entry.name)
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    os.mkdir(to)
                    self._copy_folder(path, to, uid, student, depth + 1)
                elif stat.S_ISREG(mode):
                    self._copy_file(path, to, uid, student)
                else:
                    self.log.warning("Left out %s's %s: %s", student, os.path.relpath(path, self.inbound_path),
                                     _kind(mode))

    def _copy_file(self, src: str, dest: str, uid: int, student: str) -> None:
        name = os.path.relpath(src, self.inbound_path)
        try:
            fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:  # made a link or removed since the folder was read
            self.log.warning("Left out %s's %s: %s", student, name, e.strerror)
            return
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            cap = min(self.coursedir.max_file_size * 1000, self._budget)
            why = (_kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else
                   f"owned by {_owner(st)}" if st.st_uid != uid else
                   f"{st.st_size} bytes, over the {cap}-byte cap" if st.st_size > cap else None)
            if why:
                self.log.warning("Left out %s's %s: %s", student, name, why)
                return
            data = f.read(cap + 1)  # a file still growing is cut at the cap, not followed
            if len(data) > cap:
                self.log.warning("Left out %s's %s: grew past the %s-byte cap", student, name, cap)
                return
        self._budget -= len(data)
        self._last_change = max(self._last_change, st.st_ctime)
        with open(dest, "xb") as out:
            out.write(data)

    def _date(self, dest: str, student: str) -> None:
        """The submission's time: the one its student wrote, or its last change when later."""
        written = self.coursedir.get_existing_timestamp(dest)
        changed = datetime.datetime.fromtimestamp(self._last_change, datetime.timezone.utc)
        if written is None or changed.timestamp() > written.replace(
                tzinfo=written.tzinfo or datetime.timezone.utc).timestamp() + SLACK_S:
            self.log.warning("%s's submission changed after it was filed (%s); its time is its last change, %s",
                             student, written, changed)
            with open(os.path.join(dest, "timestamp.txt"), "w") as f:
                f.write(changed.strftime("%Y-%m-%d %H:%M:%S.%f %Z"))
