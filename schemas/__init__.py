"""Wire types and subject names. Imports nothing of ours: every other package may import it."""

if __name__ != "switchyard.schemas":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.schemas, not {__name__}")

from switchyard.schemas import batch, codec, files, permissions, subjects, usage
from switchyard.schemas.codec import Codec
from switchyard.schemas.config import ConfigStruct, PositiveInt, setting
from switchyard.schemas.errors import SwitchyardError
from switchyard.schemas.kvshare import SharedBlocks
from switchyard.schemas.lazy import lazy_attributes
from switchyard.schemas.messages import *  # noqa: F403  (the message catalogue is the public API)
from switchyard.schemas.messages import __all__ as _messages_all
from switchyard.schemas.usage import UsageRecord

__all__ = [
    "Codec",
    "ConfigStruct",
    "PositiveInt",
    "SharedBlocks",
    "SwitchyardError",
    "UsageRecord",
    "batch",
    "codec",
    "files",
    "lazy_attributes",
    "permissions",
    "setting",
    "subjects",
    "usage",
    *_messages_all,
]
