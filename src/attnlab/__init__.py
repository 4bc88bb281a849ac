"""attnlab: attention mechanisms beyond scaled dot-product, exact and fast.

Subpackages (imports point down): cli > experiments > train/eval > models >
layers > cache > ops; data stands beside them.
"""

__version__ = "0.1.0"
