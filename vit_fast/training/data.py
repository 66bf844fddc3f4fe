"""Datasets and loaders for `vit-fast train`.

Three sources, all returning ``(image CHW float tensor, int label)`` on the CPU (every draw names it: a CUDA default
device must not move a dataset, nor meet a CPU generator):

- ``digits``: scikit-learn's bundled handwritten digits (1,797 real 8x8 greyscale images, no download),
  resized to ``img_size`` (bilinear), normalised with fixed statistics, split once into 1,438 train /
  359 test images (stratified, fixed seed), so every run and every machine sees the same split.
- ``imagefolder``: a torchvision ImageFolder tree ``DATA_DIR/train/<class>/*`` and ``DATA_DIR/val/<class>/*``
  with the usual ViT recipe (RandomResizedCrop + flip for training, resize + centre crop for
  evaluation, ImageNet mean/std). An unreadable image is logged with its path and skipped.
- ``synthetic``: a fixed pool of random images and labels for throughput runs (no I/O).

Training data goes through :class:`ResumableDistributedSampler`, which yields ``(epoch, index)`` pairs;
:class:`EpochSeeded` draws each sample's augmentation from a generator seeded by (seed, epoch, index), so
the images a step sees do not depend on the number of workers or ranks or on where a run was resumed.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DistributedSampler

log = logging.getLogger("vit_fast.training.data")

DATASETS = ("digits", "imagefolder", "synthetic")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DIGITS_MEAN, DIGITS_STD = 0.3, 0.33  # of the 8x8 images scaled to [0, 1], rounded: fixed, not data-dependent


@dataclass
class DataInfo:
    train: Dataset
    test: Dataset
    num_classes: int
    in_chans: int
    img_size: int


class TensorImages(Dataset):
    """Images held in memory as one (N, C, H, W) tensor, with an optional per-sample transform."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Optional[Callable] = None):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = self.images[index]
        return (self.transform(image) if self.transform else image), int(self.labels[index])


def random_shift(max_shift: int, background: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Translate an image by up to ``max_shift`` pixels each way, filling with ``background``."""

    def shift(image: torch.Tensor) -> torch.Tensor:
        dy, dx = torch.randint(-max_shift, max_shift + 1, (2,), device="cpu").tolist()
        padded = F.pad(image, (max_shift, max_shift, max_shift, max_shift), value=background)
        h, w = image.shape[-2:]
        return padded[..., max_shift + dy:max_shift + dy + h, max_shift + dx:max_shift + dx + w]

    return shift


def load_digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits as (1797, 8, 8) float pixels in 0..16 and int labels.

    Reads the csv.gz that ships inside scikit-learn directly (the same numbers as
    sklearn.datasets.load_digits, checked by the tests) because importing sklearn.datasets pulls in
    scipy and costs seconds; falls back to load_digits if the file moved.
    """
    import importlib.util
    import os

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if spec else ""
    if os.path.isfile(path):
        table = np.loadtxt(path, delimiter=",")
        pixels, target = table[:, :-1], table[:, -1]
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels, target = bunch.data, bunch.target
    return (torch.tensor(pixels, dtype=torch.float32, device="cpu").view(-1, 8, 8),
            torch.tensor(target, dtype=torch.long, device="cpu"))


def stratified_split(labels: torch.Tensor, test_fraction: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed train/test indices with each class split in the same proportion."""
    generator = torch.Generator().manual_seed(seed)
    train, test = [], []
    for cls in labels.unique().tolist():
        members = (labels == cls).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator, device="cpu")]
        n_test = round(len(members) * test_fraction)
        test.append(members[:n_test])
        train.append(members[n_test:])
    return torch.cat(train).sort().values, torch.cat(test).sort().values


def digits(img_size: int = 32, in_chans: int = 1, augment: bool = True, test_fraction: float = 0.2) -> DataInfo:
    """scikit-learn's 8x8 digits, resized to ``img_size`` and replicated to ``in_chans`` channels."""
    pixels, labels = load_digits_arrays()
    images = pixels.unsqueeze(1) / 16.0   # (N, 1, 8, 8) in [0, 1]
    images = F.interpolate(images, size=(img_size, img_size), mode="bilinear", align_corners=False)
    images = ((images - DIGITS_MEAN) / DIGITS_STD).expand(-1, in_chans, -1, -1).contiguous()
    train_idx, test_idx = stratified_split(labels, test_fraction)
    # 1/16 of the side = half an original pixel
    shift = random_shift(max(1, img_size // 16), -DIGITS_MEAN / DIGITS_STD) if augment else None
    return DataInfo(TensorImages(images[train_idx], labels[train_idx], shift),
                    TensorImages(images[test_idx], labels[test_idx]), 10, in_chans, img_size)


class SyntheticImages(Dataset):
    """``length`` samples cycling over a fixed pool of random images: measures the model, not the input pipeline."""

    def __init__(self, length: int, in_chans: int, img_size: int, num_classes: int, pool: int = 256, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.length = length
        self.images = torch.randn(min(pool, length), in_chans, img_size, img_size, generator=generator,
                                  device="cpu")
        self.labels = torch.randint(0, num_classes, (min(pool, length),), generator=generator, device="cpu")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return self.images[index % len(self.images)], int(self.labels[index % len(self.labels)])


def synthetic(img_size: int = 224, in_chans: int = 3, num_classes: int = 1000,
              train_size: int = 10_000, test_size: int = 1_000) -> DataInfo:
    return DataInfo(SyntheticImages(train_size, in_chans, img_size, num_classes, seed=0),
                    SyntheticImages(test_size, in_chans, img_size, num_classes, seed=1),
                    num_classes, in_chans, img_size)


def _image_folder_class():
    from torchvision.datasets import ImageFolder

    class SkippingImageFolder(ImageFolder):
        """ImageFolder that logs and skips an unreadable image instead of crashing the run.

        Training (``replace=True``) substitutes the next readable image so every batch keeps its size
        (ranks stay in step and compiled graphs keep their shapes); evaluation returns None, which
        :class:`EvalShard` masks out, so accuracy is computed over the readable images only.
        """

        def __init__(self, root: str, transform=None, replace: bool = True):
            super().__init__(root, transform=transform)
            self.replace = replace
            self.bad_paths: set[str] = set()   # seen by this process (each loader worker keeps its own)

        def __getitem__(self, index: int):
            for attempt in range(min(len(self.samples), 16)):
                path, target = self.samples[(index + attempt) % len(self.samples)]
                try:
                    image = self.loader(path)   # PIL open + convert('RGB'): decodes the whole file
                except Exception as err:        # PIL raises OSError, SyntaxError, ValueError... for bad files
                    if path not in self.bad_paths:
                        self.bad_paths.add(path)
                        log.warning("skipping unreadable image %s (%s: %s)", path, type(err).__name__, err)
                    if not self.replace:
                        return None
                    continue
                return (self.transform(image) if self.transform else image), target
            raise RuntimeError(f"{self.root}: 16 unreadable images in a row from index {index}; "
                               "is this the right directory?")

    return SkippingImageFolder


def imagefolder(data_dir: str, img_size: int = 224, train_dir: str = "train", val_dir: str = "val") -> DataInfo:
    import os

    from torchvision import transforms as T

    for sub in (train_dir, val_dir):
        if not os.path.isdir(os.path.join(data_dir, sub)):
            raise FileNotFoundError(f"--dataset imagefolder expects {os.path.join(data_dir, sub)}/<class>/<images>; "
                                    f"no such directory")
    normalize = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train_tf = T.Compose([T.RandomResizedCrop(img_size), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    eval_tf = T.Compose([T.Resize(int(math.floor(img_size / 0.875))), T.CenterCrop(img_size), T.ToTensor(), normalize])
    folder = _image_folder_class()
    train = folder(os.path.join(data_dir, train_dir), transform=train_tf, replace=True)
    test = folder(os.path.join(data_dir, val_dir), transform=eval_tf, replace=False)
    if train.classes != test.classes:
        raise ValueError(f"class folders differ between {train_dir}/ ({len(train.classes)}) and {val_dir}/ "
                         f"({len(test.classes)}): {sorted(set(train.classes) ^ set(test.classes))[:5]}")
    return DataInfo(train, test, len(train.classes), 3, img_size)


def build_datasets(name: str, img_size: Optional[int] = None, in_chans: Optional[int] = None,
                   num_classes: Optional[int] = None, data_dir: Optional[str] = None) -> DataInfo:
    """The train/test datasets of ``name``; ``None`` arguments take the dataset's natural value."""
    if name == "digits":
        return digits(img_size or 32, in_chans or 1)
    if name == "synthetic":
        return synthetic(img_size or 224, in_chans or 3, num_classes or 1000)
    if name == "imagefolder":
        if not data_dir:
            raise ValueError("--dataset imagefolder needs --data-dir PATH (with train/ and val/ sub-folders)")
        if in_chans not in (None, 3):
            raise ValueError(f"--dataset imagefolder gives RGB images (in_chans 3), not in_chans {in_chans}")
        return imagefolder(data_dir, img_size or 224)
    raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that yields ``(epoch, index)`` and can start part-way into an epoch.

    Rank r takes positions r, r + W, r + 2W... of the epoch's permutation (DistributedSampler's layout),
    so with a per-rank batch of B/W, step s of any world size W covers positions [s*B, (s+1)*B) of the
    same permutation: the global batches are identical for every world size, which is what lets a run
    resume on a different number of processes. ``drop_last`` is always on for training.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, seed: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Next iteration covers ``epoch`` from this rank's ``start``-th sample on."""
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):
        return ((self.epoch, index) for index in list(super().__iter__())[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start


class EpochSeeded(Dataset):
    """Wraps a training dataset: item ``(epoch, index)`` is drawn with torch's RNG seeded by (seed, epoch, index).

    The caller's RNG state is restored afterwards, so the augmentation neither depends on nor disturbs
    the training loop's random stream (dropout, drop-path).
    """

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item):
        epoch, index = item
        with torch.random.fork_rng(devices=[]):
            # the CPU generator only: torch.manual_seed would also seed (and probe) every accelerator
            torch.default_generator.manual_seed((self.seed * 1_000_003 + epoch) * 100_000_007 + index)
            return self.dataset[index]


class EvalShard(Dataset):
    """Rank r's share (r, r + W, ...) of the test set, padded to the same length on every rank with
    masked placeholders, so every rank runs the same number of forward passes (FSDP needs that)."""

    def __init__(self, dataset: Dataset, rank: int, world: int, placeholder: torch.Tensor):
        self.dataset, self.placeholder = dataset, placeholder
        self.indices = list(range(rank, len(dataset), world))
        self.length = math.ceil(len(dataset) / world)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        sample = self.dataset[self.indices[i]] if i < len(self.indices) else None
        if sample is None:   # padding, or an unreadable image (already logged by the dataset)
            return self.placeholder, 0, False
        return sample[0], sample[1], True


def build_loaders(data: DataInfo, micro_batch: int, rank: int = 0, world: int = 1, seed: int = 0, workers: int = 0,
                  pin_memory: bool = False):
    """(sampler, train loader, test loader) of one rank; the train loader yields micro-batches."""
    from torch.utils.data import DataLoader

    sampler = ResumableDistributedSampler(data.train, num_replicas=world, rank=rank, seed=seed)
    common = dict(num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0)
    # A private generator: creating a loader iterator must not draw from the global RNG (bitwise resume).
    train = DataLoader(EpochSeeded(data.train, seed), batch_size=micro_batch, sampler=sampler, drop_last=True,
                       generator=torch.Generator().manual_seed(seed), **common)
    placeholder = torch.zeros(data.in_chans, data.img_size, data.img_size, device="cpu")
    test = DataLoader(EvalShard(data.test, rank, world, placeholder), batch_size=max(micro_batch, 64),
                      shuffle=False, **common)
    return sampler, train, test
