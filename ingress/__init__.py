if __name__ != "switchyard.ingress":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.ingress, not {__name__}")

from typing import TYPE_CHECKING, Any

from switchyard.ingress.config import IngressConfig
from switchyard.ingress.tokenizer import ModelTokenizer, TokenizerError

if TYPE_CHECKING:
    from switchyard.ingress.auth import KeyRecord, KeyStore, KeyStoreError, Limits
    from switchyard.ingress.service import IngressService

_AUTH = "switchyard.ingress.auth"
_LAZY = {
    "IngressService": "switchyard.ingress.service",
    "KeyRecord": _AUTH,
    "KeyStore": _AUTH,
    "KeyStoreError": _AUTH,
    "Limits": _AUTH,
}

__all__ = [
    "IngressConfig",
    "IngressService",
    "KeyRecord",
    "KeyStore",
    "KeyStoreError",
    "Limits",
    "ModelTokenizer",
    "TokenizerError",
]


def __getattr__(name: str) -> Any:
    """The heavy parts (the HTTP service) load on first use, so that importing the
    light ones (configs, in every process's CLI) pulls no web server, engine or bus client."""
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
