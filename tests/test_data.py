"""Data sources and samplers of `vit-fast train` (vit_fast/data.py)."""
import logging

import pytest
import torch
from PIL import Image

from vit_fast.training import data


def test_digits_fixed_split_shapes_and_channels():
    a, b = data.digits(img_size=16), data.digits(img_size=16, in_chans=3)
    assert (len(a.train), len(a.test), a.num_classes, a.in_chans) == (1438, 359, 10, 1)
    assert a.train.images.shape == (1438, 1, 16, 16) and b.train.images.shape == (1438, 3, 16, 16)
    assert torch.equal(a.train.labels, b.train.labels) and torch.equal(a.test.images, b.test.images[:, :1])
    assert torch.equal(b.train.images[:, 0], b.train.images[:, 2])      # channels replicated
    counts = torch.bincount(a.test.labels, minlength=10)
    assert counts.min() >= 34 and counts.max() <= 37                      # stratified split
    assert a.train.images.abs().mean() > 0.3                              # normalised, not all background
    # the augmentation shifts but keeps the shape; without it items are the stored images
    image, label = a.train[5]
    assert image.shape == (1, 16, 16) and label == int(a.train.labels[5])
    plain = data.digits(img_size=16, augment=False)
    assert torch.equal(plain.train[5][0], plain.train.images[5])


def test_digits_are_sklearns_bundled_digits():
    from sklearn.datasets import load_digits

    pixels, labels = data.load_digits_arrays()
    bunch = load_digits()
    assert torch.equal(pixels, torch.tensor(bunch.images, dtype=torch.float32))
    assert torch.equal(labels, torch.tensor(bunch.target))


@pytest.mark.parametrize("world", [2, 4])
def test_sampler_gives_the_same_global_batches_on_any_world_size(world):
    """Step s of W ranks with per-rank batch B/W covers exactly the single-process batch s, mid-epoch starts too."""
    ds, batch = list(range(103)), 8
    single = [i for _, i in iter(_sampler(ds, 1, 0, epoch=3))]
    steps = len(single) // batch
    ranks = [[i for _, i in iter(_sampler(ds, world, r, epoch=3))] for r in range(world)]
    per_rank = batch // world
    for s in range(steps):
        union = sorted(i for r in range(world) for i in ranks[r][s * per_rank:(s + 1) * per_rank])
        assert union == sorted(single[s * batch:(s + 1) * batch])
    resumed = _sampler(ds, world, 1, epoch=3, start=5 * per_rank)
    assert list(resumed) == [(3, i) for i in ranks[1][5 * per_rank:]] and len(resumed) == len(ranks[1]) - 5 * per_rank
    assert single != [i for _, i in iter(_sampler(ds, 1, 0, epoch=4))]    # reshuffled per epoch


def _sampler(ds, world, rank, epoch, start=0):
    sampler = data.ResumableDistributedSampler(ds, num_replicas=world, rank=rank, seed=7)
    sampler.set_epoch(epoch, start=start)
    return sampler


def test_epoch_seeded_augmentation_is_reproducible_and_leaves_global_rng_alone():
    ds = data.EpochSeeded(data.digits(img_size=32).train, seed=1)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = [ds[(0, i)][0] for i in range(40)]
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(x, ds[(0, i)][0]) for i, x in enumerate(first))
    assert not all(torch.equal(x, ds[(1, i)][0]) for i, x in enumerate(first))   # new epoch, new shifts


def test_synthetic():
    info = data.build_datasets("synthetic", img_size=16, in_chans=3, num_classes=7)
    image, label = info.train[300]
    assert image.shape == (3, 16, 16) and 0 <= label < 7 and len(info.train) == 10_000
    assert torch.equal(info.train[300][0], info.train[300 % 256][0])


@pytest.mark.parametrize("name", ["digits", "synthetic"])
def test_datasets_stay_on_the_cpu_under_another_default_device(name):
    """Datasets are built on the CPU whatever torch's default device (a CUDA one in users' scripts and in the GPU
    test run: a CPU generator's draw onto it fails); the meta device stands in for it here."""
    torch.set_default_device("meta")
    try:
        info = data.build_datasets(name, img_size=16)
        image, label = info.train[5]
    finally:
        torch.set_default_device(None)
    assert image.device.type == "cpu" and isinstance(label, int)


def _write_image_tree(root, corrupt_in=("train", "val")):
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for k in range(3):
                Image.fromarray(torch.randint(0, 255, (20, 24, 3), dtype=torch.uint8).numpy()).save(folder / f"{k}.png")
        if split in corrupt_in:
            (root / split / "cat" / "1_broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")


def test_imagefolder_skips_and_reports_unreadable_images(tmp_path, caplog):
    _write_image_tree(tmp_path)
    info = data.build_datasets("imagefolder", img_size=16, data_dir=str(tmp_path))
    assert (info.num_classes, info.in_chans, len(info.train), len(info.test)) == (2, 3, 7, 7)
    broken = str(tmp_path / "train" / "cat" / "1_broken.png")
    with caplog.at_level(logging.WARNING, logger="vit_fast.training.data"):
        items = [info.train[i] for i in range(len(info.train))]
    assert all(image.shape == (3, 16, 16) for image, _ in items)         # replaced, batch size kept
    assert broken in caplog.text and "skipping unreadable image" in caplog.text
    bad_val = [i for i, (path, _) in enumerate(info.test.samples) if "broken" in path]
    assert info.test[bad_val[0]] is None                                  # evaluation drops it
    assert info.test[0][0].shape == (3, 16, 16)


def test_imagefolder_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="--data-dir"):
        data.build_datasets("imagefolder")
    with pytest.raises(FileNotFoundError, match="train"):
        data.build_datasets("imagefolder", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown dataset"):
        data.build_datasets("mnist")
