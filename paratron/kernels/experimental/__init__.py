"""Kernels pinned to a beta version or to private internals of a library (kernels/README.md, "Experimental").

Rules: the core reaches these only through the kernel switches record (each has a switch that turns it off);
each checks its pin at run time and steps aside when the installed version differs; each is removed when its
pin can no longer be installed; each has a GPU test against the reference of the op it replaces."""
