if __name__ != "switchyard.ingress":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.ingress, not {__name__}")

from typing import TYPE_CHECKING

from switchyard.ingress.batch_config import BatchRunnerConfig
from switchyard.ingress.config import IngressConfig
from switchyard.ingress.tokenizer import ModelTokenizer, TokenizerError
from switchyard.schemas import lazy_attributes

if TYPE_CHECKING:
    from switchyard.ingress.auth import KeyRecord, KeyStore, KeyStoreError, Limits
    from switchyard.ingress.batch_client import BatchClient, BatchRejected, NoBatchRunner
    from switchyard.ingress.batch_runner import BatchRunner
    from switchyard.ingress.files import FileNotFound, FileObject, FileStore
    from switchyard.ingress.service import IngressService

_AUTH = "switchyard.ingress.auth"
_FILES = "switchyard.ingress.files"
_LAZY = {
    "BatchClient": "switchyard.ingress.batch_client",
    "BatchRejected": "switchyard.ingress.batch_client",
    "NoBatchRunner": "switchyard.ingress.batch_client",
    "BatchRunner": "switchyard.ingress.batch_runner",
    "FileNotFound": _FILES,
    "FileObject": _FILES,
    "FileStore": _FILES,
    "IngressService": "switchyard.ingress.service",
    "KeyRecord": _AUTH,
    "KeyStore": _AUTH,
    "KeyStoreError": _AUTH,
    "Limits": _AUTH,
}

__all__ = [
    "BatchClient",
    "BatchRejected",
    "BatchRunner",
    "BatchRunnerConfig",
    "FileNotFound",
    "FileObject",
    "FileStore",
    "IngressConfig",
    "IngressService",
    "KeyRecord",
    "KeyStore",
    "KeyStoreError",
    "Limits",
    "ModelTokenizer",
    "NoBatchRunner",
    "TokenizerError",
]


__getattr__ = lazy_attributes(__name__, _LAZY)
