"""The signal pad: this rank's 64-bit slots that peers signal into, and where its own
lanes and kernels signal the peers' pads.  The only object that knows where a slot
lives: the executor reads its tables (``waits``, ``signals``, and their direct-kernel
twins), made once, and the health monitor its words."""

from __future__ import annotations

import logging
from typing import Any, Collection, List, Optional, Tuple

from .._errors import HocclError
from ..backends._base import Device
from ..backends._kernels import DIRECT_WORDS
from ..sched.algorithms import KERNEL_MAX_BLOCKS
from ..sched.plan import CHANNEL_NAMES, CHANNELS

__all__ = ["ABORT_VALUE", "SignalPad"]

log = logging.getLogger("hoccl")

# a direct kernel writes and waits for every one of a slot's words (``_kernels``)
assert DIRECT_WORDS == KERNEL_MAX_BLOCKS, "the pad's kernel words are the kernel's signal words"

#: written into signal pads by an abort: larger than any value a collective waits for,
#: so every stream-side wait is released; seeing it in a pad means "aborted".
ABORT_VALUE = 1 << 62


class SignalPad:
    """This rank's signal pad and the peers' pads it signals into.

    Layout: ``world_size * CHANNELS`` 64-bit slots, slot ``sender * CHANNELS + channel``
    written only by ``sender`` (so values only grow), then as many *graph* slots (the
    same slots for calls captured into CUDA graphs: each is put back to 0 after its last
    wait, ``hoccl.sched.replay``), then one *completion* word that this rank's lane 0
    writes when a call ends and its callers' streams wait on; then the direct kernels'
    part (``Plan.kernel_blocks``): their epoch and finished-block count, per slot
    ``KERNEL_MAX_BLOCKS`` words, one for each block of the sender's kernel, and two
    copies (even and odd epochs) of those words for the signatures of the calls the
    senders' kernels signalled from (``signature_shift``, ``signature_half``).
    """

    def __init__(self, device: Device, rank: int, world_size: int):
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.slots = world_size * CHANNELS
        #: where a slot's graph twin is: ``slot + graph_offset``
        self.graph_offset = self.slots
        kernel_words = self.slots * KERNEL_MAX_BLOCKS
        self.words_total = 2 * self.slots + 1 + 2 + 3 * kernel_words
        self.address = device.alloc_pad(self.words_total)
        #: bytes from a direct kernel's signal word to its signature twin of even epochs,
        #: and from that to the odd epochs' twin
        self.signature_shift = self.signature_half = 8 * kernel_words
        self.completion = self.address + 8 * 2 * self.slots
        #: the direct kernels' epoch and finished-block count (``DirectProgram.counter``)
        self.kernel_counter = self.completion + 8
        self._kernel_offset = 8 * (2 * self.slots + 3)
        #: the address of each slot (eager, then graph slots) in this rank's pad, where its
        #: lanes wait, and of each direct-kernel slot's block 0 word: the executor's tables
        self.waits: List[Any] = [self.local(slot) for slot in range(2 * self.slots)]
        self.kernel_waits: List[Any] = [self.kernel_local(slot) for slot in range(self.slots)]
        #: the peers' pads mapped for this rank's writes (``import_peers``), dropped by
        #: ``release``
        self._imported: List[Any] = []
        self.connect([self.address] * world_size)

    def export(self) -> Any:
        """This pad's export descriptor, for the peers' ``import_peers``."""
        return self.device.export(self.address, 8 * self.words_total)

    def import_peers(self, descriptors: List[Any]) -> None:
        """Map every peer's pad from its ``export`` (``descriptors[rank]``; this rank's own
        is not used), held for this rank's writes until ``release``, and ``connect``."""
        pads = []
        for peer, descriptor in enumerate(descriptors):
            if peer == self.rank:
                pads.append(self.address)
            else:
                pads.append(self.device.import_pad(descriptor))
                self._imported.append(descriptor)
        self.connect(pads)

    def release(self) -> None:
        """This rank's lanes, kernels and abort pump have stopped: give its pad back and
        let go of the peers' (``Device.free_pad``, ``Device.drop_pad``)."""
        self.device.free_pad(self.address)
        imported, self._imported = self._imported, []
        for descriptor in imported:
            self.device.drop_pad(descriptor)

    def connect(self, pads: List[Any]) -> None:
        """``pads[peer]``: the peer's pad as this process addresses it (mapped or direct).
        Fills ``signals[peer][slot]`` and ``kernel_signals[peer][slot]``: where this rank's
        lanes and kernels signal each slot of each peer's pad."""
        self._pads = list(pads)
        self.signals: List[List[Any]] = [[self.remote(peer, slot)
                                          for slot in range(2 * self.slots)]
                                         for peer in range(self.world_size)]
        self.kernel_signals: List[List[Any]] = [[self.kernel_remote(peer, slot)
                                                 for slot in range(self.slots)]
                                                for peer in range(self.world_size)]

    def local(self, slot: int) -> Any:
        """The address of ``slot`` in this rank's own pad (what its lanes wait on)."""
        return self.address + 8 * slot

    def remote(self, peer: int, slot: int) -> Any:
        """The address of ``slot`` in ``peer``'s pad (what this rank's lanes write)."""
        return self._pads[peer] + 8 * slot

    def kernel_local(self, slot: int) -> Any:
        """Block 0's word of ``slot`` in this rank's direct-kernel slots (what its kernels
        wait on; block ``b``'s is ``8 * b`` further)."""
        return self.address + self._kernel_offset + 8 * KERNEL_MAX_BLOCKS * slot

    def kernel_remote(self, peer: int, slot: int) -> Any:
        """Block 0's word of ``slot`` in ``peer``'s direct-kernel slots (what this rank's
        kernels write)."""
        return self._pads[peer] + self._kernel_offset + 8 * KERNEL_MAX_BLOCKS * slot

    @staticmethod
    def describe(slot: int) -> Tuple[int, str]:
        """(sender, channel name) of a slot."""
        sender, channel = divmod(slot, CHANNELS)
        return sender, CHANNEL_NAMES[channel]

    def words(self) -> List[int]:
        """The slots' values (eager, then graph slots), read from the host past every
        stream."""
        return self.device.peek(self.address, 2 * self.slots)

    def aborted_by(self) -> Optional[int]:
        """The peer whose abort value is in this pad (its slots, or its direct kernels'),
        if one is."""
        try:
            words = self.words()
            kernel = self.device.peek(self.kernel_local(0), self.slots * KERNEL_MAX_BLOCKS)
        except HocclError:
            return None
        for slot, word in enumerate(words):
            if word >= ABORT_VALUE:
                return (slot % self.slots) // CHANNELS
        for index, word in enumerate(kernel):
            if word >= ABORT_VALUE:
                return (index // KERNEL_MAX_BLOCKS) // CHANNELS
        return None

    def poison(self, host_word: Any, warn: bool, gone: Collection[int] = ()) -> None:
        """The abort value into every own slot, the completion and host words, and the
        slots this rank writes in every peer's pad but those of the ``gone`` peers (closed
        or exited: nobody waits in their pads any more)."""
        own = [(self.local(slot), ABORT_VALUE) for slot in range(self.words_total)]
        own.append((host_word.address, ABORT_VALUE))
        try:
            self.device.poke(own)
        except HocclError as error:
            if warn:
                log.warning("rank %d abort: could not poison its own pad: %s", self.rank, error)
        for peer in range(self.world_size):
            if peer == self.rank or peer in gone:
                continue
            try:
                mine = [self.rank * CHANNELS + channel for channel in range(CHANNELS)]
                self.device.poke([(self.remote(peer, offset + slot), ABORT_VALUE)
                                  for offset in (0, self.graph_offset) for slot in mine]
                                 + [(self.kernel_remote(peer, slot) + 8 * block, ABORT_VALUE)
                                    for slot in mine for block in range(KERNEL_MAX_BLOCKS)])
            except HocclError as error:
                if warn:
                    log.warning("rank %d abort: could not release peer %d: %s", self.rank,
                                peer, error)
