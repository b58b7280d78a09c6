"""A small convolutional network for square one-channel images: a model contract example.

gradsync passes the data's sizes that the constructor names (here image_size, num_classes, from
digits_cnn.data.digit_images) plus the keyword arguments of conf/model/cnn.yaml."""

from __future__ import annotations

from typing import Any

from torch import nn

from gradsync.components import CheckContext, checks, require


def _check(args: dict[str, Any], ctx: CheckContext) -> None:
    require(args["channels"] >= 1, "model.channels", "an integer >= 1", args["channels"])


@checks(_check)
class SmallCNN(nn.Sequential):
    def __init__(self, image_size: int, num_classes: int, channels: int = 16):
        super().__init__(
            nn.Conv2d(1, channels, kernel_size=3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, kernel_size=3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # image_size / 2 on each side
            nn.Flatten(),
            nn.Linear(channels * (image_size // 2) ** 2, num_classes),
        )
