"""labkit.feeding.packing, labkit.feeding.batching and labkit.feeding.collate: valid, near-optimal packing, and packed == unpacked training."""
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from labkit.feeding.batching import POLICIES, Batch, compare_policies, make_batches, padding_stats
from labkit.feeding.collate import IGNORE, collate, segments
from labkit.core.model import GPTConfig, build_model
from labkit.feeding.packing import lower_bound, pack

ROOT = Path(__file__).resolve().parent.parent


def _naive_bfd_fills(lengths, capacity):
    """Textbook best-fit decreasing, one item at a time over every open row: the reference."""
    rooms = []
    for n in sorted(lengths, reverse=True):
        fits = [b for b, r in enumerate(rooms) if r >= n]
        if fits:
            best = min(fits, key=lambda b: rooms[b])
            rooms[best] -= n
        else:
            rooms.append(capacity - n)
    return sorted(capacity - r for r in rooms)


def _check_valid(rows, lengths, capacity):
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))  # every index exactly once
    assert all(sum(lengths[i] for i in r) <= capacity for r in rows)  # no row over capacity
    assert all(r for r in rows)


def test_pack_is_exactly_best_fit_decreasing_on_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(200):
        C = int(rng.integers(1, 50))
        L = rng.integers(1, C + 1, int(rng.integers(1, 60))).tolist()
        rows = pack(L, C)
        _check_valid(rows, L, C)
        assert sorted(rows.fill.tolist()) == _naive_bfd_fills(L, C)
        assert rows.fill.tolist() == [sum(L[i] for i in r) for r in rows]
    # plain Python ints in plain lists (not numpy scalars): rows go straight into JSON and torch.tensor
    assert all(type(r) is list and all(type(i) is int for i in r) for r in rows)


def test_pack_small_example_by_hand():
    rows = pack([3, 7, 5, 5, 2, 8], 10)
    # BFD: 8 -> new; 7 -> new; 5 -> new; 5 -> row of 5; 3 -> row of 7; 2 -> row of 8
    assert sorted(sorted(r) for r in rows) == [[0, 1], [2, 3], [4, 5]]
    assert rows.efficiency == 1.0 and rows.n_overflow == 0 and rows.tokens_dropped == 0


def test_efficiency_within_0_05_percent_of_the_bound_on_lognormal_lengths():
    rng = np.random.default_rng(1)
    for C in (1024, 2048, 4096):
        L = np.clip(np.round(rng.lognormal(5.0, 1.0, 200_000)), 1, C).astype(int)
        rows = pack(L, C)
        bound = math.ceil(L.sum() / C)
        assert lower_bound(L, C) == bound  # few sequences exceed C/2: the token count is the bound
        assert bound <= len(rows) <= bound * 1.0005, (C, len(rows), bound)
        assert rows.fill.sum() == L.sum() and rows.fill.max() <= C


def _pack_counting_lines(lengths, capacity):
    """``pack(lengths, capacity)`` and the number of lines of labkit/feeding/packing.py it executed (a
    line in a loop once per pass): its Python work, counted the same on an idle or a loaded machine."""
    import labkit.feeding.packing as packing

    count = 0

    def line(frame, event, arg):
        nonlocal count
        count += event == "line"
        return line

    def call(frame, event, arg):  # trace only packing.py's own frames (and its comprehensions)
        return line if frame.f_code.co_filename == packing.__file__ else None

    before = sys.gettrace()
    sys.settrace(call)
    try:
        rows = pack(lengths, capacity)
    finally:
        sys.settrace(before)
    return rows, count


def test_one_million_sequences_pack_in_near_linear_work():
    """Speed belongs to bench/bench_packing.py; this only catches an accidental O(n^2), by counting
    instead of timing: ten times the sequences (the same distribution) may cost about ten times the
    Python lines (n log n: 12x), not a hundred. The rest of the work is NumPy's sort and bincounts."""
    L = np.clip(np.round(np.random.default_rng(2).lognormal(5.0, 1.0, 1_000_000)), 1, 2048).astype(int)
    _, lines_100k = _pack_counting_lines(L[:100_000], 2048)
    rows, lines_1m = _pack_counting_lines(L, 2048)
    assert 0 < lines_1m < 20 * lines_100k, (lines_100k, lines_1m)
    assert sum(len(r) for r in rows) == 1_000_000 and rows.fill.max() <= 2048
    assert np.array_equal(np.sort(np.concatenate([np.asarray(r) for r in rows])), np.arange(1_000_000))
    assert rows.fill.sum() == L.sum() and len(rows) <= math.ceil(L.sum() / 2048) * 1.0005


def test_overflow_needs_an_explicit_choice():
    with pytest.raises(ValueError, match=r"2 sequences are longer than capacity=10 .*lengths\[1\]=25.*"
                                         r"overflow='split'.*overflow='truncate'"):
        pack([4, 25, 10, 11], 10)


def test_overflow_split_keeps_every_token_and_counts_the_pieces():
    L = [4, 25, 10, 11, 3]
    rows = pack(L, 10, overflow="split")
    assert rows.n_overflow == 2 and rows.tokens_dropped == 0
    assert rows.n_pieces == 3 + 2  # 25 -> 10 + 10 + 5, 11 -> 10 + 1
    assert rows.fill.sum() == sum(L) and rows.fill.max() <= 10
    pieces = segments(rows, L, 10)
    covered = {}
    for row in pieces:
        for i, start, n in row:
            covered.setdefault(i, []).append((start, n))
    for i, n in enumerate(L):  # the pieces of each sequence tile it exactly, in row order
        spans = covered[i]
        assert [s for s, _ in spans] == list(range(0, n, 10)) and sum(k for _, k in spans) == n
    assert [sum(p[2] for p in row) for row in pieces] == rows.fill.tolist()


def test_overflow_truncate_counts_dropped_tokens():
    L = [4, 25, 10, 11, 3]
    rows = pack(L, 10, overflow="truncate")
    _check_valid(rows, [min(n, 10) for n in L], 10)
    assert rows.n_overflow == 2 and rows.tokens_dropped == 15 + 1 and rows.n_pieces == 0
    assert rows.fill.sum() == sum(min(n, 10) for n in L)
    assert rows.report()["tokens_dropped"] == 16


@pytest.mark.parametrize("call, match", [
    (lambda: pack([], 8), "lengths is empty"),
    (lambda: pack([3, 0, 2], 8), r"lengths must be positive integers; lengths\[1\]=0"),
    (lambda: pack([3, -2], 8), r"lengths\[1\]=-2"),
    (lambda: pack([3.5, 2], 8), "lengths must be integers"),
    (lambda: pack([[1, 2]], 8), "1-D"),
    (lambda: pack([3, 2], 0), "capacity must be a positive integer, got 0"),
    (lambda: pack([3, 2], -4), "capacity must be a positive integer"),
    (lambda: pack([3, 2], 8.0), "capacity must be a positive integer"),
    (lambda: pack([3, 2], True), "capacity must be a positive integer"),
    (lambda: pack([3, 2], 8, overflow="drop"), "overflow='drop' is unknown; valid: None, 'split' or 'truncate'"),
    (lambda: lower_bound([], 8), "lengths is empty"),
    (lambda: lower_bound([3, 9], 8), "lengths up to 9 exceed capacity=8"),
    (lambda: make_batches([3, 2], "bucket", max_len=8), r"policy='bucket' is unknown; valid policies: \['pad_to_max'"),
    (lambda: make_batches([3, 9], "random", max_len=8), "lengths up to 9 exceed max_len=8"),
    (lambda: make_batches([3, 2], "token_budget", max_len=8), "needs max_tokens"),
    (lambda: make_batches([3, 2], "token_budget", max_len=8, max_tokens=4), "max_tokens=4 cannot hold"),
    (lambda: make_batches([3, 2], "random", max_len=8, batch_size=0), "batch_size must be a positive integer"),
    (lambda: padding_stats([3, 2], []), "batches is empty"),
])
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_train_policies_names_bad_arguments():
    from labkit.feeding.collate import train_policies

    docs = [torch.arange(4)] * 2
    for kwargs, match in [(dict(steps=0), "steps must be a positive integer, got 0"),
                          (dict(warmup=-1), "warmup must be a non-negative integer"),
                          (dict(policies=[]), "policies is empty")]:
        args = dict(policies=["packed"], lengths=[4, 4], docs=docs, capacity=8, model_cfg=GPTConfig(block_size=8),
                    batch_size=2, megabatch=1, lr=1e-3, steps=1) | kwargs
        with pytest.raises(ValueError, match=match):
            train_policies(**args)


def test_padding_stats_by_hand():
    L = [1, 2, 3, 4]
    s = padding_stats(L, [Batch([[0], [1]], 4), Batch([[2], [3]], 4)])  # pad_to_max, max_len 4
    assert (s.real_tokens, s.padded_tokens, s.padding_fraction) == (10, 16, 6 / 16)
    assert (s.tokens_per_batch_mean, s.tokens_per_batch_min, s.tokens_per_batch_max) == (5, 3, 7)
    assert s.tokens_per_batch_std == 2.0
    packed = padding_stats(L, make_batches(L, "packed", max_len=4, batch_size=8))
    assert packed.padded_tokens == 12 and packed.padding_fraction == pytest.approx(2 / 12)  # [4] [3 1] [2]


def test_policies_cover_the_data_once_and_order_by_padding():
    L = np.clip(np.round(np.random.default_rng(3).lognormal(4.5, 0.8, 5000)), 2, 512).astype(int)
    stats = compare_policies(L, max_len=512, batch_size=16, megabatch=50, seed=0)
    assert list(stats) == list(POLICIES)
    for p in POLICIES:
        batches = make_batches(L, p, max_len=512, batch_size=16, max_tokens=16 * 512, seed=0)
        assert sorted(i for b in batches for r in b.rows for i in r) == list(range(len(L))), p
        assert stats[p].real_tokens == L.sum()
        if p == "token_budget":
            assert all(len(b.rows) * b.width <= 16 * 512 for b in batches)
    pad = {p: s.padding_fraction for p, s in stats.items()}
    assert pad["pad_to_max"] == pytest.approx(1 - L.mean() / 512)
    assert pad["pad_to_max"] > pad["random"] > pad["length_grouped"] > pad["packed"]
    assert pad["token_budget"] < pad["random"] and pad["packed"] < 0.01
    # a token budget evens out the real tokens per batch; fixed-size batches do not
    cv = {p: s.tokens_per_batch_std / s.tokens_per_batch_mean for p, s in stats.items()}
    assert cv["token_budget"] < cv["length_grouped"]


def test_collate_restarts_positions_masks_boundaries_and_padding():
    docs = [torch.tensor([10, 11, 12]), torch.tensor([20, 21]), torch.tensor([30, 31, 32, 33])]
    out = collate([[0, 1], [2]], docs, capacity=6)
    assert out["input_ids"].tolist() == [[10, 11, 12, 20, 21, 0], [30, 31, 32, 33, 0, 0]]
    assert out["labels"].tolist() == [[11, 12, IGNORE, 21, IGNORE, IGNORE], [31, 32, 33, IGNORE, IGNORE, IGNORE]]
    assert out["position_ids"][0, :5].tolist() == [0, 1, 2, 0, 1]
    assert out["doc_ids"].tolist() == [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, -1, -1]]
    assert out["n_tokens"].item() == 9
    assert collate([[2]], docs, capacity=6, width=4)["input_ids"].shape == (1, 4)
    with pytest.raises(ValueError, match="a row holds 7 tokens, more than capacity=6"):
        collate([[0, 2]], docs, capacity=6)
    with pytest.raises(ValueError, match="width must be a positive integer >= the fullest row"):
        collate([[2]], docs, capacity=6, width=3)
    with pytest.raises(ValueError, match="index 1 appears 2 times"):
        collate([[1], [1]], docs, capacity=6)


def test_doc_mask_with_one_document_equals_the_causal_fast_path():
    model = build_model(GPTConfig(block_size=16), seed=0).eval()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = model(idx)[0]
    same = model(idx, position_ids=torch.arange(16).expand(2, 16), doc_ids=torch.zeros(2, 16, dtype=torch.long))[0]
    torch.testing.assert_close(same, ref, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"doc_ids must have the shape of idx \(2, 16\), got \(2, 15\)"):
        model(idx, doc_ids=torch.zeros(2, 15, dtype=torch.long))


def test_packed_batch_gives_the_losses_and_gradients_of_the_sequences_run_alone():
    """fp32: per-sequence losses within 1e-5 and gradients within 1e-5 (abs) + 1e-4 (rel)."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 20, (12,), generator=g).tolist()
    docs = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    rows = pack(lengths, cfg.block_size)
    assert len(rows) < len(docs)  # really packed: several sequences share a row

    packed_model = build_model(cfg, seed=0)
    batch = collate(rows, docs, capacity=cfg.block_size)
    logits, _ = packed_model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"])
    tok = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none").view_as(batch["labels"])
    packed_losses = {}
    for r, row in enumerate(rows):
        for d, i in enumerate(row):
            sel = (batch["doc_ids"][r] == d) & (batch["labels"][r] != IGNORE)
            packed_losses[i] = tok[r][sel].sum() / (lengths[i] - 1)
    sum(packed_losses.values()).backward()

    alone_model = build_model(cfg, seed=0)
    alone_losses = {}
    for i, doc in enumerate(docs):
        targets = torch.cat([doc[1:], torch.tensor([IGNORE])])[None]
        alone_losses[i] = alone_model(doc[None], targets)[1]
    sum(alone_losses.values()).backward()

    for i in range(len(docs)):
        torch.testing.assert_close(packed_losses[i], alone_losses[i], rtol=0, atol=1e-5)
    for (name, p), q in zip(packed_model.named_parameters(), alone_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    # Without the document mask the sequences of a row leak into each other: the test can fail.
    leaky = packed_model(batch["input_ids"], position_ids=batch["position_ids"])[0]
    assert (leaky - logits).abs().max() > 1e-3


def test_bench_runs_at_tiny_size(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_packing.py"), "--n", "3000",
                           "--capacity", "1024", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    res = {r["packer"]: r for r in json.loads(out.read_text())}
    assert set(res) == {"labkit bfd", "trl bfd", "trl bfd, one batch", "ffd (scan)", "next-fit"}
    # TRL's BFD over one batch is the same algorithm: the same number of rows
    assert res["trl bfd, one batch"]["rows"] == res["labkit bfd"]["rows"] == res["ffd (scan)"]["rows"]
    assert res["next-fit"]["rows"] > res["labkit bfd"]["rows"]
    assert "rows/labkit" in proc.stdout
