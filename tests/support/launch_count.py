"""Count launches of Triton kernel objects: stand a :class:`Counting` wrapper in for a module's
kernel (``monkeypatch.setattr(mod, "_kernel", Counting(mod._kernel, "name", counts))``) and every
``kernel[grid](...)`` adds one to ``counts["name"]`` before launching the real kernel (its return
value, the compiled kernel, passes through). Used to show which of two kernels ran."""

from __future__ import annotations

from collections import Counter


class Counting:
    def __init__(self, kernel, name: str, counts: Counter):
        self.kernel, self.name, self.counts = kernel, name, counts

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.counts[self.name] += 1
            return launch(*args, **kwargs)
        return run


def count_launches(monkeypatch, module, **kernels: str) -> Counter:
    """Stand :class:`Counting` wrappers in for ``module``'s kernels (``attr="name"``) for one
    test; returns the counter they share."""
    counts: Counter = Counter()
    for attr, name in kernels.items():
        monkeypatch.setattr(module, attr, Counting(getattr(module, attr), name, counts))
    return counts
