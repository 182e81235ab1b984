"""Custom ops and library bindings, each beside its plain-torch reference (kernels/README.md lists them).

Nothing here imports the model, the parallel layers or the training loop: callers pass tensors and the
choices of the kernel switches record (``--kernel-...``, config/kernels.py; resolved in switches.py).
``experimental/`` holds code pinned to a beta version or a private API of a library, reached only through
the switches record."""
