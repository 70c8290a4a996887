"""Small 28x28 grayscale image datasets for the recipes: a torchvision dataset on disk, else one that works offline."""

from __future__ import annotations

import torch
import torchvision
from torch.utils.data import Dataset, TensorDataset

__all__ = ["TORCHVISION_DATASETS", "synthetic_images", "sklearn_digits", "image_dataset"]

TORCHVISION_DATASETS = ("FashionMNIST", "MNIST", "KMNIST")


def synthetic_images(n: int = 2048, classes: int = 10, seed: int = 0) -> TensorDataset:
    """Learnable 28x28 images: a fixed random pattern per class plus noise."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(classes, 1, 28, 28, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(prototypes[labels] + 1.5 * torch.randn(n, 1, 28, 28, generator=g), labels)


def sklearn_digits() -> TensorDataset | None:
    """scikit-learn's bundled 8x8 digits, upsampled to 28x28, or None without scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        return None
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    return TensorDataset((images - 0.5) / 0.5, torch.tensor(digits.target, dtype=torch.long))


def image_dataset(name: str, data_dir: str | None, download: bool = False, offline: str = "synthetic",
                  synthetic_size: int = 2048) -> tuple[Dataset, str]:
    """The named torchvision dataset from ``data_dir``; without ``data_dir``, offline data. Returns (data, description).

    Args:
        offline: "synthetic", or "digits" for scikit-learn's digits where installed (synthetic otherwise).

    Raises:
        SystemExit: ``data_dir`` is given but holds no such dataset.
    """
    if data_dir is None:
        if offline == "digits":
            digits = sklearn_digits()
            if digits is not None:
                return digits, "scikit-learn's digits upsampled to 28x28 (offline; pass --data-dir for FashionMNIST)"
        return (synthetic_images(synthetic_size),
                f"synthetic images made in-process ({synthetic_size}; offline; pass --data-dir for {name})")
    if name not in TORCHVISION_DATASETS:
        raise SystemExit(f"unknown dataset {name!r}; valid: {', '.join(TORCHVISION_DATASETS)}")
    transform = torchvision.transforms.Compose([torchvision.transforms.ToTensor(), torchvision.transforms.Normalize((0.5,), (0.5,))])
    try:
        data = getattr(torchvision.datasets, name)(data_dir, train=True, download=download, transform=transform)
    except RuntimeError as e:
        raise SystemExit(f"{name} is not in {data_dir} ({e}); add --download if this machine has a network") from None
    return data, f"{name} from {data_dir}"
