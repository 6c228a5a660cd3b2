"""nbgrader's ``collect``, keeping each student's own submission.

nbgrader files a submission under the name its submitter claims (``nbgrader submit --student=alice``
claims Alice's), collects the newest one per name, and only logs "cheating attempt?" when the folder's
owner is someone else (``nbgrader/exchange/default/collect.py``). The newest is what counts, and
its timestamp is written by the submitter, so a student could have their copy graded in place of
another's. On a hub where each person is a unix user (``make hub``, and Kubernetes with
``labkit-start``), the owner is the truth: :class:`OwnedCollect` leaves out every submission
not owned by the person it names, and says so. The course directory's ``nbgrader_config.py``, the
hub image's and ``make hub``'s per-role settings name it, so the formgrader collects with it too.
"""
from __future__ import annotations

import os
import pwd

from nbgrader.exchange.default.collect import ExchangeCollect


def _owner(path: str) -> str:
    try:
        return pwd.getpwuid(os.stat(path).st_uid).pw_name
    except KeyError:
        return "unknown id"


class OwnedCollect(ExchangeCollect):
    """Collect only the submissions whose folder belongs to the student they are filed under; of
    a name with none, nothing (nbgrader would take a stranger's copy and warn)."""

    def _sort_by_timestamp(self, records: list[dict]) -> list[dict]:
        owned = []
        for record in records:
            owner = _owner(os.path.join(self.inbound_path, record["filename"]))
            if owner == record["username"]:
                owned.append(record)
            else:
                self.log.warning("Left out %s: filed under %s but owned by %s", record["filename"],
                                 record["username"], owner)
        # nbgrader takes the first record of every name: for a name with none of its own, a marker
        # that copy_files drops
        return super()._sort_by_timestamp(owned) or [{**records[0], "left_out": True}]

    def copy_files(self) -> None:
        self.src_records = [r for r in self.src_records if not r.get("left_out")]
        super().copy_files()
