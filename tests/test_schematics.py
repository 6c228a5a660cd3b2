"""The book's schematics: what labkit draws is what is committed, each is an SVG with a title that a
chapter shows, and every number or group a figure draws is the one labkit's own code computes."""
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from labkit.labs import schematics
from labkit.memory import GB, estimate_memory, model_state_breakdown
from labkit.parallel.pipeline.stages import schedule_order
from labkit.parallel.pipeline.timeline import bubble_formula

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "book" / "images"
SVG = "{http://www.w3.org/2000/svg}"
REGENERATE = "regenerate with `python -m labkit.labs.schematics` and commit book/images"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("schematics")
    assert schematics.write_all(out) == [out / name for name in schematics.FIGURES]
    return out


def _svg(name: str) -> ET.Element:
    return ET.parse(IMAGES / name).getroot()


@pytest.mark.parametrize("name", sorted(schematics.FIGURES))
def test_committed_figure_is_byte_for_byte_what_labkit_draws(regenerated, name):
    assert (IMAGES / name).is_file(), f"book/images/{name} is missing; {REGENERATE}"
    assert (regenerated / name).read_bytes() == (IMAGES / name).read_bytes(), f"{name} drifted; {REGENERATE}"


@pytest.mark.parametrize("name", sorted(schematics.FIGURES))
def test_figure_is_an_svg_with_a_title_shown_by_a_chapter_with_a_caption(name):
    root = _svg(name)
    assert root.tag == f"{SVG}svg" and root.get("viewBox")
    title = root.find(f"{SVG}title")
    assert title is not None and title.text.strip()
    figure = re.compile(r"```\{figure\} images/" + re.escape(name) + r"\n:name: fig-[\w-]+\n(?::\w+: .*\n)*\n(.+)\n")
    shown = {md.name: figure.search(md.read_text()) for md in (ROOT / "book").glob("*.md")}
    shown = {k: m for k, m in shown.items() if m}
    assert shown, f"no chapter shows images/{name} in a {{figure}} with a :name:"
    assert all(len(m.group(1)) > 40 for m in shown.values()), "each figure needs a caption saying what to look at"


def test_70b_bars_carry_the_calculators_numbers():
    """Recomputed here with the arguments of `python -m labkit.planning memory --model llama2-70b
    --devices 8 --device-type a100-80gb`, not taken from the generator."""
    configs = {"DDP": {"stage": 0}, "ZeRO-1": {"stage": 1}, "ZeRO-2": {"stage": 2}, "ZeRO-3": {"stage": 3},
               "ZeRO-3 + full recompute + optimizer offload": {"stage": 3, "recompute": "full",
                                                               "offload_optimizer": True}}
    expected = {}
    for label, kw in configs.items():
        e = estimate_memory("llama2-70b", micro_batch=1, world_size=8, device_memory_gb=80, **kw)
        expected[label] = {"params": e.params, "grads": e.grads, "optimizer": e.optimizer,
                           "activations": e.activations + e.head}
        assert sum(expected[label].values()) == e.total
    numbers = schematics.memory_70b_numbers()
    assert numbers["device_gb"] == 80 and list(numbers["bars"]) == list(configs)
    drawn, per_gb = {}, set()
    for rect in _svg("memory_70b.svg").iter(f"{SVG}rect"):
        if rect.get("data-part"):
            gb = float(rect.get("data-gb"))
            drawn.setdefault(rect.get("data-config"), {})[rect.get("data-part")] = gb
            if gb:
                per_gb.add(round(float(rect.get("width")) / gb, 2))
    for label, parts in expected.items():
        for part, nbytes in parts.items():
            assert numbers["bars"][label][part] == nbytes / GB, (label, part)
            assert drawn[label][part] == round(nbytes / GB, 1), (label, part)
    assert len(per_gb) == 1, f"bar lengths are not proportional to GB: {per_gb}"
    totals = [float(t.get("data-total-gb")) for t in _svg("memory_70b.svg").iter(f"{SVG}text") if t.get("data-total-gb")]
    assert totals == [round(sum(p.values()) / GB, 1) for p in expected.values()]
    assert any("80 GB" in (t.text or "") for t in _svg("memory_70b.svg").iter(f"{SVG}text"))


def test_zero_holdings_shade_exactly_the_bytes_the_calculator_gives_each_rank():
    n, rects = 4, [r for r in _svg("zero_holdings.svg").iter(f"{SVG}rect") if r.get("data-stage")]
    unit = min(float(r.get("height")) for r in rects) / 2  # the fp16 rows: 2 bytes per parameter
    for stage in range(4):
        held = [r for r in rects if r.get("data-stage") == str(stage) and not r.get("stroke-dasharray")]
        bytes_per_param = sum(float(r.get("height")) / unit for r in held) / n / n  # a shard is 1/n of a row
        psi = 1000 * n
        assert bytes_per_param == model_state_breakdown(psi, n, stage).total / psi, stage


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ideal_schedule_follows_labkits_order_and_dependencies_and_shows_the_formulas_bubble(schedule):
    p, m = 4, 8
    events = schematics.ideal_timeline(schedule, p, m)
    end = {(kind, s, i): stop for s, kind, i, _, stop in events}
    for s in range(p):
        mine = sorted((start, kind, i) for st, kind, i, start, _ in events if st == s)
        assert [(kind, i) for _, kind, i in mine] == schedule_order(schedule, p, s, m)
    for s, kind, i, start, _ in events:
        if kind == "F" and s:
            assert start >= end[("F", s - 1, i)]
        if kind == "B":
            assert start >= end[("F", s, i)] and (s == p - 1 or start >= end[("B", s + 1, i)])
    makespan = max(end.values())
    idle = 1 - sum(stop - start for *_, start, stop in events) / (p * makespan)
    assert idle == pytest.approx(bubble_formula(p, m))


def test_mesh_groups_are_the_groups_torch_device_mesh_forms():
    """DeviceMesh makes one group per dimension from ``mesh.swapdims(-1, dim).reshape(-1, size)``."""
    import torch

    for shape in ({"dp": 2, "tp": 4}, {"pp": 2, "dp": 2, "tp": 4}):
        mesh = torch.arange(16)[:int(torch.tensor(list(shape.values())).prod())].reshape(*shape.values())
        groups = schematics.mesh_groups(shape)
        for d, name in enumerate(shape):
            torch_groups = mesh.swapdims(-1, d).reshape(-1, mesh.size(d)).tolist()
            assert sorted(groups[name]) == sorted(torch_groups), (shape, name)
