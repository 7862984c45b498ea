"""Stand-ins for process groups in CPU tests."""


class FakeGroup:
    """A process group that only answers ``rank()`` and ``size()``."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size
