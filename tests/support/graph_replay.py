"""A stand-in for a CUDA graph where there is no CUDA: ``EagerReplay`` runs the captured forward again on
each replay, with the capture's attention metadata. Its host lists stay as they were at capture (as a
graph bakes in every launch argument the host computed), while the static input tensors change in place,
so a replay gives a graph's results exactly when the forward's launches depend only on tensor shapes and
device data, and goes wrong where they do not (``test_decode_graphs``'s negative control)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class EagerReplay:
    def __init__(self) -> None:
        #: forwards captured, and replays run
        self.captures = 0
        self.replays = 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = forward()
        self.captures += 1

        def replay() -> None:
            with torch.inference_mode():  # the forward's output is an inference tensor
                out.copy_(forward())
            self.replays += 1

        return replay, out
