"""The MTP tree drafter, reading each step's sampled tokens on the host as a drafter of host contexts does
(``reads_contexts``): after a step without trees its first pass takes the sampled token from the host list instead
of the device tensor. Tests compare the two ways: they must draft the same trees."""

from ..spec_decode.mtp_tree_drafter import MTPTreeDrafter


class HostTokensMTPDrafter(MTPTreeDrafter):
    reads_contexts = True
