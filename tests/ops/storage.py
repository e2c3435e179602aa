"""Tensors placed in shared storage, for tests of state kept per address (the TMA's tensor maps)."""


def in_storage(tensors, storages):
    """Each tensor copied to the front of its storage (a flat buffer of its dtype), as a view of its
    shape: calls that place their arguments so get them at the same addresses whatever their shapes."""
    views = []
    for t, st in zip(tensors, storages):
        view = st[:t.numel()].view(t.shape)
        view.copy_(t)
        views.append(view)
    return views
