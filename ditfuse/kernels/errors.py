"""Exceptions shared by kernels. Imports neither torch nor triton."""


class UnsupportedInput(ValueError):
    """Raised by a kernel for an input it does not reproduce bit-exactly (or does not handle).

    Kernels never return None for "not handled": they raise this with the reason, and the
    ``can_use_<op>`` predicate returns False for exactly the same inputs.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
