"""A device tensor on its way to the host without waiting for the work queued before it."""

import torch


class HostCopy:
    """``tensor`` copied into a pinned buffer of its own (torch's caching host allocator keeps it until the copy
    is done, so a later copy never overwrites one still unread), with the event that marks the copy done. On CPU
    the tensor itself."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.event = tensor, None
        if tensor.is_cuda:
            self.tensor = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.tensor.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def done(self) -> bool:
        """Whether the copy is done (never waits)."""
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy is done."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensor
