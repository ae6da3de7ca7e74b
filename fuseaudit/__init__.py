"""fuseaudit: is a fused kernel right, is it really fused, and is it worth it?"""

__version__ = "0.1.0"
