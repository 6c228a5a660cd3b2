import hashlib

import pytest
import torch

from labkit.core.data import CORPUS, check_shard, decode, get_batch, load_corpus, train_val_split


def test_shipped_corpus_is_the_public_domain_shakespeare():
    assert hashlib.sha256(CORPUS.read_bytes()).hexdigest() == (
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed")
    data = load_corpus()
    assert data.dtype == torch.uint8 and len(data) == CORPUS.stat().st_size
    assert decode(data[:9]) == "First Cit"


def test_batches_are_next_byte_targets():
    data = load_corpus()
    x, y = get_batch(data, step=0, batch_size=4, block_size=16, seed=0)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_batches_depend_only_on_seed_and_step():
    data = load_corpus()
    torch.manual_seed(1)
    a = get_batch(data, 5, 8, 16, seed=3)
    torch.manual_seed(2)
    b = get_batch(data, 5, 8, 16, seed=3)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], get_batch(data, 6, 8, 16, seed=3)[0])
    assert not torch.equal(a[0], get_batch(data, 5, 8, 16, seed=4)[0])


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_rank_shards_partition_the_global_batch(world):
    data = load_corpus()
    full_x, full_y = get_batch(data, 3, 8, 16, seed=0)
    parts = [get_batch(data, 3, 8, 16, seed=0, rank=r, world_size=world) for r in range(world)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), full_y)


def test_train_val_split_is_disjoint_and_complete():
    data = load_corpus()
    s = train_val_split(data, 0.1)
    assert len(s.train) + len(s.val) == len(data)
    assert torch.equal(torch.cat([s.train, s.val]), data)


def test_world_size_that_cannot_split_the_batch_is_named():
    with pytest.raises(ValueError, match=r"world_size=3 does not divide the global batch_size=8; "
                                         r"valid world sizes for this batch: \[1, 2, 4, 8\]"):
        check_shard(8, 3)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        check_shard(8, 0)


def test_missing_corpus_names_the_parameter(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"corpus='.*nope.txt' is not a file"):
        load_corpus(missing)


def test_rank_out_of_range_and_short_corpus_are_rejected():
    data = load_corpus()
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        get_batch(data, 0, 8, 16, rank=2, world_size=2)
    with pytest.raises(ValueError, match="block_size=16 needs a corpus longer"):
        get_batch(data[:10], 0, 8, 16)
