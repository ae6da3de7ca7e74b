"""Reference fused Triton kernels, one op family per module.

Installed as ``fuseaudit.kernels``.  Each public function has the canonical
signature of its op in :mod:`fuseaudit.catalog`; the catalog names the
function that implements each op, so nothing is imported here eagerly (the
interpreter switch ``TRITON_INTERPRET`` must be set before a kernel module is
imported).
"""
