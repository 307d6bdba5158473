"""Wire types and subject names. Imports nothing of ours: every other package may import it."""

from schemas import subjects
from schemas import codec
from schemas.codec import Codec
from schemas.messages import *  # noqa: F403  (the message catalogue is the public API)
from schemas.messages import __all__ as _messages_all

__all__ = ["subjects", "codec", "Codec", *_messages_all]
