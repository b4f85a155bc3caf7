"""cudnn_train: training fusion layers for large models, backed by CuTeDSL kernels.

Public names:
    last_path(op)          which backend served the latest call of an op
    use_backend(name)      force a backend (context manager); also CUDNN_TRAIN_BACKEND
    deterministic(flag)    bitwise reproducible backward passes; also CUDNN_TRAIN_DETERMINISTIC=1
    Unsupported            what a backend raises to decline a call
"""

from .fla import accelerate_fla, is_accelerated, restore_fla
from .backend import Unsupported, deterministic, is_deterministic, last_path, registered_ops, use_backend

__version__ = "0.1.0"

__all__ = [
    "Unsupported",
    "accelerate_fla",
    "is_accelerated",
    "restore_fla",
    "deterministic",
    "is_deterministic",
    "last_path",
    "registered_ops",
    "use_backend",
    "__version__",
]
