"""One call records a lab's number for the text (glue) and for its metrics file."""
import json

import numpy as np

from labkit.labs import record as rec


def test_recorded_values_reach_the_metrics_file_as_json_holds_them(tmp_path, monkeypatch):
    monkeypatch.setattr(rec, "GLUED", {})
    assert rec.record("speedup", np.float64(1.5)) == 1.5 and type(rec.GLUED["speedup"]) is float  # no np.float64 repr
    rec.record("ranks", [np.int64(2), 3])
    rec.record("nothing", float("nan"))
    rec.record("by_rank", {"0": 1.0, "1": [2, 3]})
    rec.record("figure", object())  # a matplotlib figure or a styled table: for the text only
    rec.record("table", [object()])
    path = rec.write_metrics(tmp_path / "lab.metrics.json", profile="ci", params={"steps": 2})
    m = json.loads(path.read_text())
    env = m.pop("environment")  # what the run ran on, for a regression run's report (labkit.labs.compare)
    assert {"torch", "python", "cpu_capability", "threads", "machine"} <= set(env) and env["threads"] >= 1
    assert m == {"profile": "ci", "params": {"steps": 2},
                 "recorded": {"speedup": 1.5, "ranks": [2, 3], "nothing": None, "by_rank": {"0": 1.0, "1": [2, 3]}}}
    assert set(rec.GLUED) == {"speedup", "ranks", "nothing", "by_rank", "figure", "table"}


def test_one_call_records_many_as_keywords_and_a_wrong_call_is_one_line(monkeypatch):
    import pytest

    monkeypatch.setattr(rec, "GLUED", {})
    assert rec.record(zf_world=4, zf_steps=np.int64(20)) is None
    assert list(rec.GLUED.items()) == [("zf_world", 4), ("zf_steps", 20)]
    for bad in (lambda: rec.record("a"), lambda: rec.record("a", 1, b=2), lambda: rec.record(), lambda: rec.record(None, 1)):
        with pytest.raises(TypeError, match=r"record\(name, value\) or record\(name1=value1"):
            bad()
